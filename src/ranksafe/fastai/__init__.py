"""fastai integration: ``Learner(..., cbs=RankSafe())`` or ``class MyLearner(RankSafeLearner, Learner)``.

Importable only where fastai is installed; the ranksafe core never imports this package. Importing it changes no
fastai class: everything happens on the Learners that RankSafe is attached to.
"""

try:
    import fastai  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("ranksafe.fastai needs fastai: pip install 'ranksafe[fastai]'") from e

from .callback import RankSafe, RankSafeLearner
from .distributed import CPUDistributed, follow_process_group, prepare_distributed
from .learner import (
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
    "CPUDistributed",
    "RankSafe",
    "RankSafeLearner",
    "export_data",
    "follow_process_group",
    "load_data",
    "load_encoder",
    "load_learner",
    "load_model",
    "load_pretrained",
    "prepare_distributed",
    "save_encoder",
    "save_model",
]
