"""The demo-model builder: moved to `worker.tools.demo_model`; this alias keeps old imports working."""

from worker.tools.demo_model import byte_level_bpe, make_demo_model

__all__ = ["byte_level_bpe", "make_demo_model"]
