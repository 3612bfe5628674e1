"""Modes and outcomes are Enums whose members are their strings: a user passes either, a bad value names the choices."""

import json
import re

import pytest

import ranksafe
from ranksafe import AgreeOp, BestMode, BusyPolicy, StepStatus, Storage, Writer
from ranksafe.lightning import MonitorAgreement, MonitorOp

BAD = [
    (lambda root: ranksafe.CheckpointManager(root, storage="nfs"), "Storage takes 'auto', 'shared', 'local'"),
    (lambda root: ranksafe.CheckpointManager(root, best_mode="lowest"), "BestMode takes 'min', 'max', not 'lowest'"),
    (lambda root: ranksafe.AsyncSaver(policy="later"), "BusyPolicy takes 'wait', 'skip', not 'later'"),
    (lambda root: ranksafe.AsyncSaver(writer="some"), "Writer takes 'main', 'local', 'all', not 'some'"),
    (lambda root: ranksafe.save(1, f"{root}/x.pt", writer="some"), "Writer takes"),
    (lambda root: ranksafe.agree(1, "median"), "AgreeOp takes 'all', 'any', 'max', 'min', 'sum', 'mean', 'main'"),
    (lambda root: MonitorAgreement("median"), "MonitorOp takes 'mean', 'main', 'max', 'min', not 'median'"),
]


@pytest.mark.parametrize("make, said", BAD, ids=[s.split()[0] for _, s in BAD])
def test_a_value_outside_the_choices_is_refused_naming_them(tmp_path, make, said):
    with pytest.raises(ValueError, match=re.escape(said)):
        make(str(tmp_path))
    assert not (tmp_path / "x.pt").exists()


def test_members_and_their_strings_are_interchangeable(tmp_path):
    for kind in (AgreeOp, BestMode, BusyPolicy, StepStatus, Storage, Writer, MonitorOp):
        for member in kind:
            assert kind(member.value) is member and member == member.value and f"{member}" == member.value
    assert ranksafe.agree(3, AgreeOp.MAX) == ranksafe.agree(3, "max") == 3
    by_member = ranksafe.CheckpointManager(tmp_path / "a", storage=Storage.SHARED, best_mode=BestMode.MAX)
    by_string = ranksafe.CheckpointManager(tmp_path / "b", storage="shared", best_mode="max")
    assert by_member.placement == by_string.placement and by_member.retention.best_mode is BestMode.MAX
    by_string.save(1, {"w": 1})
    (tmp_path / "b" / ".step_00000002.ranksafe-partial").mkdir()
    steps = ranksafe.list_steps(tmp_path / "b")
    assert [s.status for s in steps] == [StepStatus.COMMITTED, StepStatus.INCOMPLETE]
    assert json.loads(json.dumps([s.status for s in steps])) == ["committed", "incomplete"]  # a report, as strings
