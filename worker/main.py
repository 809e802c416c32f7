"""`python -m worker.main`: the old entry point of `ferry worker`, kept for launchers that use it."""

from worker.serve.main import Worker, main

__all__ = ["Worker", "main"]

if __name__ == "__main__":
    raise SystemExit(main())
