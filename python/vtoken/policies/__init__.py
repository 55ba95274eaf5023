"""Token-level eviction policies behind one small contract (docs/architecture.md §2, docs/policies.md).

``vtoken.policies.get(name, **cfg)`` builds a registered policy; ``available()``
lists the names: ``h2o``, ``random``, ``scissorhands``, ``snapkv``,
``streamingllm``, ``tova``. Each policy is one module of fewer than 50 lines
whose docstring gives its definition and source. See :mod:`vtoken.policies.base`
for the view, budgets and traces, :mod:`vtoken.policies.scores` for the
score sources and :mod:`vtoken.policies.ids` for the live-id checks both use.
"""
from vtoken.policies.base import (  # noqa: F401
    AT_MODES,
    Budget,
    BudgetRaisedWarning,
    Decision,
    EvictionPolicy,
    PolicyView,
    ReplayDivergenceError,
    ReplayPolicy,
    TraceRecorder,
    available,
    decision_plan,
    get,
    lowest,
    register,
)
from vtoken.policies.scores import ScoreAccumulator, accumulate_batch, window_key_scores  # noqa: F401

# Importing the policy modules registers them.
from vtoken.policies import h2o, random, scissorhands, snapkv, streamingllm, tova  # noqa: E402,F401
from vtoken.policies.h2o import H2O  # noqa: E402,F401
from vtoken.policies.random import RandomPolicy  # noqa: E402,F401
from vtoken.policies.scissorhands import Scissorhands  # noqa: E402,F401
from vtoken.policies.snapkv import SnapKV  # noqa: E402,F401
from vtoken.policies.streamingllm import StreamingLLM  # noqa: E402,F401
from vtoken.policies.tova import TOVA  # noqa: E402,F401
