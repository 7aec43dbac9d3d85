"""The farm's service, in three layers: `app.domain` (settings, database, blob store, services,
the queue protocol, the job kinds, `open_farm`), the web face standing on it (`app.main`,
`app.api`, `app.web`) and the console tools (`app.console`). See docs/service.md."""
