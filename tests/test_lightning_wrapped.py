"""What RankSafe puts on Lightning's objects: picklable during ``fit`` (``pickle`` and ``torch.save``, as stock
Lightning's objects are), gone after it, on success and on failure (the attributes of the strategy, the checkpoint
and signal connectors, the training epoch loop and the callbacks are those of a stock run, the signal handlers those
before the run), and a ModelCheckpoint stand-in without ``dirpath``.
Multi-rank runs check the same in tests/test_lightning_ddp.py."""

from __future__ import annotations

import io
import pickle
import signal
from unittest.mock import Mock

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

from ranksafe.lightning import RankSafe, RankSafeCheckpointIO, compat
from ranksafe.lightning.wrapped import Wrapped, unwrap, wrap
from tests.test_lightning import Model, _loader


def _objects(trainer: pl.Trainer) -> dict[str, object]:
    """Every object RankSafe wraps methods of, its own two, and the Trainer, by name."""
    objects = {
        "trainer": trainer,
        "strategy": trainer.strategy,
        "connector": compat.checkpoint_connector(trainer),
        "signals": compat.signal_connector(trainer),
        "epoch_loop": compat.epoch_loop(trainer),
        "ModelCheckpoint": trainer.checkpoint_callback,
        "EarlyStopping": trainer.early_stopping_callback,
        "checkpoint_io": trainer.strategy.checkpoint_io,  # RankSafeCheckpointIO in our runs
    }
    for cb in trainer.callbacks:
        if isinstance(cb, RankSafe):
            objects["RankSafe"] = cb
    return objects


def _unpicklable(objects: dict[str, object]) -> list[str]:
    failed = []
    for name, obj in objects.items():
        for how, dump in (("pickle", pickle.dumps), ("torch.save", lambda o: torch.save(o, io.BytesIO()))):
            try:
                dump(obj)
            except Exception as e:
                failed.append(f"{how} {name}: {e!r}")
    return failed


_WRAPPED_OWNERS = ("strategy", "connector", "signals", "epoch_loop", "ModelCheckpoint", "EarlyStopping")


def _wrapped(trainer: pl.Trainer) -> list[str]:
    return sorted(
        f"{owner}.{name}"
        for owner, obj in _objects(trainer).items()
        if owner in _WRAPPED_OWNERS
        for name, value in vars(obj).items()
        if isinstance(value, Wrapped)
    )


def _attributes(trainer: pl.Trainer) -> dict[str, list[str]]:
    return {owner: sorted(vars(obj)) for owner, obj in _objects(trainer).items() if owner in _WRAPPED_OWNERS}


def _handlers() -> dict[str, object]:
    return {s.name: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}


class PickleProbe(pl.Callback):
    """At the third step, while RankSafe's wrappers are installed: what is wrapped, and what fails to pickle."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.fail_at = fail_at
        self.wrapped: list[str] = []
        self.unpicklable: list[str] | None = None
        self.original_after_unpickling: object = None
        self.handlers: set[str] = set()  # the classes of the signal handlers (the handlers would pickle with it)

    def on_train_batch_end(self, trainer, pl_module, *args):
        if trainer.global_step == 3:
            self.wrapped = _wrapped(trainer)
            self.handlers = {type(getattr(h, "__self__", h)).__name__ for h in _handlers().values()}
            self.unpicklable = _unpicklable(_objects(trainer))
            copy = pickle.loads(pickle.dumps(trainer.strategy))
            if isinstance(vars(copy).get("optimizer_step"), Wrapped):
                self.original_after_unpickling = vars(copy)["optimizer_step"].original()
        if trainer.global_step == self.fail_at:
            raise RuntimeError("injected failure")


def _fit(root, ours: bool, async_io: bool = False, fail_at: int | None = None) -> tuple[pl.Trainer, PickleProbe]:
    probe = PickleProbe(fail_at)
    callbacks = [
        ModelCheckpoint(dirpath=root / "ckpts", monitor="val_loss", every_n_train_steps=2, save_last="link"),
        EarlyStopping(monitor="val_loss", patience=5, check_on_train_epoch_end=False),
        probe,
    ]
    if ours:  # every wrapper that a single process installs
        callbacks.append(RankSafe(checkpoint_dir=root / "managed", keep=1, async_save=True, preemption=True))
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, callbacks=callbacks,
        plugins=[RankSafeCheckpointIO(async_save=async_io)] if ours else [],
    )  # fmt: skip
    if fail_at is None:
        trainer.fit(Model(), _loader(), _loader())
    else:
        with pytest.raises(RuntimeError, match="injected failure"):
            trainer.fit(Model(), _loader(), _loader())
    return trainer, probe


@pytest.mark.parametrize("async_io", [False, True], ids=["sync-io", "async-io"])
def test_everything_pickles_during_fit_and_after_it_no_ranksafe_attribute_is_left(tmp_path, async_io):
    before = _handlers()
    stock, stock_probe = _fit(tmp_path / "stock", ours=False)
    trainer, probe = _fit(tmp_path / "ours", ours=True, async_io=async_io)
    assert stock_probe.unpicklable == [] and stock_probe.wrapped == []  # stock Lightning pickles all of these
    assert probe.wrapped == sorted(
        ["connector.resume_start", "strategy.load_checkpoint", "strategy.optimizer_step"]
        + ["ModelCheckpoint._link_checkpoint", "ModelCheckpoint.on_train_batch_end"]
        + ["ModelCheckpoint.on_train_epoch_end", "ModelCheckpoint.on_validation_end"]  # skipped after a stop
        + ["ModelCheckpoint.on_train_end"]  # the same
        + ["EarlyStopping.on_train_batch_end", "EarlyStopping.on_train_epoch_end", "EarlyStopping.on_validation_end"]
        + ["signals.register_signal_handlers", f"epoch_loop.{compat.VALIDATION_DUE}"]
        + (["ModelCheckpoint.file_exists"] if async_io else [])
    )  # installed while the probe pickled them
    assert probe.unpicklable == []
    assert probe.handlers == {"_Handler"}  # ranksafe's recorder's handler, during fit
    assert _handlers() == before
    # a bound method would pickle as getattr(strategy, "optimizer_step") and could come back as the wrapper itself
    assert not isinstance(probe.original_after_unpickling, Wrapped)
    assert probe.original_after_unpickling.__func__ is type(trainer.strategy).optimizer_step

    assert _wrapped(trainer) == [] and _attributes(trainer) == _attributes(stock)
    assert _unpicklable(_objects(trainer)) == []
    assert len(list((tmp_path / "ours" / "ckpts").iterdir())) == len(list((tmp_path / "stock" / "ckpts").iterdir()))


def test_after_a_failed_fit_no_ranksafe_attribute_is_left(tmp_path):
    stock, _ = _fit(tmp_path / "stock", ours=False, fail_at=5)
    before = _handlers()
    trainer, probe = _fit(tmp_path / "ours", ours=True, async_io=True, fail_at=5)
    assert "strategy.optimizer_step" in probe.wrapped  # installed until the failure
    assert _wrapped(trainer) == [] and _attributes(trainer) == _attributes(stock) and _handlers() == before
    assert _unpicklable(_objects(trainer)) == []


def test_a_model_checkpoint_stand_in_without_dirpath_does_not_break_fit_start(tmp_path):
    stand_in = Mock(spec=ModelCheckpoint)  # what tests of user code pass; it has no instance attributes
    with pytest.raises(AttributeError):
        stand_in.dirpath  # noqa: B018
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[stand_in, RankSafe(overwrite=True)], default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(Model(), _loader(), _loader())
    assert trainer.global_step == 4 and trainer.checkpoint_callback is stand_in
    assert stand_in.on_fit_start.call_count == 1  # Lightning ran it: the stand-in stood in for the whole fit


class Thing:
    """A framework object: a method and a staticmethod (as ModelCheckpoint._link_checkpoint is)."""

    def __init__(self) -> None:
        self.steps = 0

    def step(self, x: int) -> int:
        self.steps += 1
        return x + 1

    @staticmethod
    def link(a: str, b: str) -> str:
        return f"{a}->{b}"


class Around:
    """What RankSafe is to the wrappers: a picklable object whose bound methods they call."""

    def plus_ten(self, original, x):
        return original(x) + 10

    def shout(self, original, a, b):
        return original(a, b).upper()


class NaiveWrapper:
    """The control: keeps the replaced method as a bound method."""

    def __init__(self, obj, name):
        self.original = getattr(obj, name)
        vars(obj)[name] = self

    def __call__(self, *args):
        return self.original(*args) + 10


def test_wrap_pickles_calls_the_class_method_after_unpickling_never_wraps_twice_and_unwraps():
    # control: a bound method pickles as getattr(obj, name); unpickled from the wrapper, that is the wrapper itself
    naive = NaiveWrapper(Thing(), "step")
    copy = pickle.loads(pickle.dumps(naive))
    assert copy.original is copy
    with pytest.raises(RecursionError):
        copy(1)

    thing, around = Thing(), Around()
    stock = set(vars(thing))
    wrap(thing, "step", around.plus_ten)
    wrap(thing, "link", around.shout)
    assert (thing.step(1), thing.link("a", "b")) == (12, "A->B")
    wrapper = pickle.loads(pickle.dumps(vars(thing)["step"]))  # the wrapper first, as in the control
    assert wrapper(1) == 12 and wrapper.obj.step(1) == 12
    wrap(wrapper.obj, "step", around.plus_ten)  # setup again on the copy: the wrapper is replaced, not wrapped
    assert wrapper.obj.step(1) == 12
    unwrap(thing)
    unwrap(wrapper.obj)
    assert set(vars(thing)) == stock and (thing.step(1), thing.link("a", "b")) == (2, "a->b")
    assert set(vars(wrapper.obj)) == stock
    with pytest.raises(AttributeError, match="missing"):
        wrap(thing, "missing", around.plus_ten)
