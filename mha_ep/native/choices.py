"""Process-wide choices of the native planner: gpu.py's ``plan_call`` reads them whenever it plans a call signature.

Tests and benchmarks change them through ``mha_ep.native.settings`` (this module's ``settings``, the same object);
``mha_ep.native.reset_plans`` applies a change to signatures already planned. They live in a module of their own
so that gpu.py need not import the package's ``__init__``, which imports gpu.py to configure the library with it.
"""

from __future__ import annotations


class Settings:
    """The choices; the class attributes are their defaults."""

    fused_path = True  # False: every call takes the three phases (MHA_EP_THREE_PHASE=1 does the same)
    poison = False  # fill every temporary with NaN before the kernels run (tests)
    plans_ahead = 16  # after a miss on a growing past, plan the next this many steps' signatures (ahead.py); 0: off


settings = Settings()
