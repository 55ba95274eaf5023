"""Token-level eviction policies behind one small contract (docs/architecture.md §2, docs/policies.md).

``vtoken.policies.get(name, **cfg)`` builds a registered policy; ``available()``
lists the names: ``h2o``, ``random``, ``scissorhands``, ``snapkv``,
``streamingllm``, ``tova``. Each policy is one module of fewer than 50 lines
whose docstring gives its definition and source. See :mod:`vtoken.policies.base`
for the view and budgets, :mod:`vtoken.policies.trace` for recorded victim
traces and their replay, :mod:`vtoken.policies.scores` for the score sources
and :mod:`vtoken.policies.ids` for the live-id checks they use.
"""
from vtoken.policies.base import (  # noqa: F401
    AT_MODES,
    Budget,
    BudgetRaisedWarning,
    EvictionPolicy,
    PolicyView,
    available,
    decision_plan,
    get,
    lowest,
    register,
)
from vtoken.policies.scores import ScoreAccumulator, accumulate_batch, window_key_scores  # noqa: F401
from vtoken.policies.trace import Decision, ReplayDivergenceError, ReplayPolicy, TraceRecorder  # noqa: F401

# Importing the policy modules registers them.
from vtoken.policies import h2o, random, scissorhands, snapkv, streamingllm, tova  # noqa: E402,F401
from vtoken.policies.h2o import H2O  # noqa: E402,F401
from vtoken.policies.random import RandomPolicy  # noqa: E402,F401
from vtoken.policies.scissorhands import Scissorhands  # noqa: E402,F401
from vtoken.policies.snapkv import SnapKV  # noqa: E402,F401
from vtoken.policies.streamingllm import StreamingLLM  # noqa: E402,F401
from vtoken.policies.tova import TOVA  # noqa: E402,F401
