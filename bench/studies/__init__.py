"""The studies: one script per docs/performance.md section, run by hand to reproduce it.

Each module's docstring names the section it reproduces and how to run it
(`python -m bench.studies.X --help`); tests/bench runs each small. Not part of any
`kvroute` command. Beside them, what several studies measure with: instant_backend.py
(a backend that answers at once), streams.py (thousands of SSE clients) and pipe.py (a
bare TCP pipe, the floor under any Python proxy).

May import the harness (bench.harness), the simulator (bench.sim), router/, policies/,
hashing/ and each other; nothing in bench imports them.
"""
