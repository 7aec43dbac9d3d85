"""The console tools (`qpcfarm ...`): the CLI, the HTTP client, submit, configure, and the
composition roots (`serve`, `worker`) that alone know both the web face and the worker."""
