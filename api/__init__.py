"""Ferry's HTTP API (`ferry.api`): FastAPI routes over the job queue. Imports no torch."""

if __name__ == "api":  # imported by its bare name from a checkout: become an alias of ferry.api
    from ferry.worker.common.legacy_names import alias

    alias("api", "ferry.api")
