"""Control: the processes, their roles, and how the config changes while they run.

  serve.py       run one process until SIGTERM (drain) or SIGINT; SIGHUP reloads
  heap.py        the C heap keeps what a long prompt freed for the next (glibc's mallopt)
  worker.py      `Router`: a process that serves (its request path, the shared tables);
                 alone it is the whole router, telemetry in-process
  request_path.py
                 a worker's records, dispatcher, jobs and listeners: opened in order,
                 drained together, closed
  shared_tables.py
                 the run directory's tables a worker of several shares with the others
  joining.py     a worker of several following the collector: its feed, verdicts, edits
  collector.py   `Collector`: the process of several that faces the backends and feeds
                 the workers
  node.py        `Node`: the parts both roles are composed of
  listeners.py   a worker's HTTP (fast path first), admin and gRPC listeners
  supervisor.py  `serve --workers N`: ports, run directory, children, restarts, signals
  paths.py       the paths the workers will write, checked before any starts
  reload.py      SIGHUP and admin reloads: build, validate, swap
  tls.py         the listeners' certificates: read at start, renewed by a reload
  admin.py       the admin API, on its own listener and token
  probe.py       `kvroute health`: GET /health on the config's listener, over loopback

May import every stage. Nothing imports it but router/__main__.py (the CLI).
"""
