"""The farm's domain: settings, database, blob store, services, the queue protocol and the
job-kind table. The web face (`app.main`, `app.api`, `app.web`) and the worker stand on it; it
imports neither (only `compiler_core`). Importing it loads nothing heavy."""
