"""The farm's logic as plain functions over a SQLAlchemy Session, shared by the API and worker.

Convention: functions the API calls (create, submit, cancel, validate) only flush; the caller
commits (then enqueues). Functions the worker calls on a job it runs (claim, report_progress,
succeed, fail, run_compile) commit themselves, because other processes must see their effect
at once.
"""
