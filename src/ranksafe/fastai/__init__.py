"""fastai integration: ``Learner(..., cbs=RankSafe())`` or ``class MyLearner(RankSafeLearner, Learner)``.

Importable only where fastai is installed; the ranksafe core never imports this package.
"""

try:
    import fastai  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("ranksafe.fastai needs fastai: pip install 'ranksafe[fastai]'") from e

from .callback import RankSafe
from .cpu import enable_cpu_distributed, follow_process_group
from .learner import (
    RankSafeLearner,
    export_data,
    load_data,
    load_encoder,
    load_learner,
    load_model,
    load_pretrained,
    save_encoder,
    save_model,
)

__all__ = [
    "RankSafe",
    "RankSafeLearner",
    "enable_cpu_distributed",
    "export_data",
    "follow_process_group",
    "load_data",
    "load_encoder",
    "load_learner",
    "load_model",
    "load_pretrained",
    "save_encoder",
    "save_model",
]
