"""``deepspeed.ops``: the optimizers DeepSpeed scripts import from it (:mod:`.adam`)."""

from . import adam

__all__ = ["adam"]
