"""The LoRA adapters one server serves: the static `lora_adapters`, then runtime loads.

Runtime loading follows vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter (with
VLLM_ALLOW_RUNTIME_LORA_UPDATING): a name is reserved when its load starts, so of two
concurrent loads of one name exactly one succeeds, and it is served only once the load
has taken its `lora_load_ms`. Adapter ids are never reused, as vLLM's lora_int_id counter.
A restart forgets runtime loads (a new process starts with its command line's adapters)
and fails a load in progress; the load and unload counts survive it, like engine stats.
"""

import asyncio

from bench.sim.params import SimParams, scaled_seconds


class LoraError(Exception):
    """A refused load or unload, answered with this HTTP status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class LoraAdapters:
    def __init__(self, params: SimParams) -> None:
        self.params = params
        self.loads = 0
        self.unloads = 0
        self._roots: dict[str, str] = {}  # served name -> its path (the card's root)
        self._ids: dict[str, int] = {}
        self._loading: set[str] = set()
        self._last_id = 0
        self._epoch = 0  # restarts so far
        self.reset()

    @property
    def names(self) -> list[str]:
        return list(self._roots)

    @property
    def loading(self) -> list[str]:
        return sorted(self._loading)

    def reset(self) -> None:
        """Back to the static adapters only (a process restart)."""
        self._roots = {n: f"/sim/lora/{n}" for n in self.params.lora_adapters}
        self._ids = {n: i + 1 for i, n in enumerate(self._roots)}
        self._loading = set()
        self._last_id = len(self._ids)
        self._epoch += 1

    def id(self, name: str) -> int:
        """The 1-based id of a served adapter; KeyError if it is not served."""
        return self._ids[name]

    def root(self, name: str) -> str:
        return self._roots[name]

    async def load(self, name: str, path: str) -> None:
        """Serve `name` after the simulated load time; LoraError if refused."""
        if not name or not path:
            raise LoraError(400, "Both 'lora_name' and 'lora_path' must be provided.")
        if name in self._roots or name in self._loading or name == self.params.model:
            raise LoraError(400, f"The lora adapter '{name}' has already been loaded.")
        if len(self._roots) + len(self._loading) >= self.params.max_loras:
            raise LoraError(
                400,
                f"Cannot load LoRA adapter '{name}': max_loras={self.params.max_loras} "
                "adapters are already loaded. Unload one first.",
            )
        loading, epoch = self._loading, self._epoch
        loading.add(name)
        try:
            await asyncio.sleep(scaled_seconds(self.params, self.params.lora_load_ms))
        finally:
            loading.discard(name)
        if epoch != self._epoch:
            raise LoraError(503, f"The server restarted while loading '{name}'.")
        self._last_id += 1
        self._roots[name] = path
        self._ids[name] = self._last_id
        self.loads += 1

    def unload(self, name: str) -> None:
        """Stop serving `name`; LoraError if it is not served."""
        if not name:
            raise LoraError(400, "'lora_name' needs to be provided to unload a LoRA adapter.")
        if name not in self._roots:
            raise LoraError(404, f"The lora adapter '{name}' cannot be found.")
        del self._roots[name], self._ids[name]
        self.unloads += 1
