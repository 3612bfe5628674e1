"""Benchmarks of ranksafe's save paths against the baselines a user would otherwise have, measured in one run.

``python -m benchmarks`` runs every script below (each in its own process, so one's memory does not hide
another's) and prints one markdown table of ratios to the baseline of each benchmark, with the targets:

* ``lightning_io``: RankSafeCheckpointIO / atomic_save vs Lightning's TorchCheckpointIO vs raw write + fsync.
* ``save_path``: atomic_save vs stock torch.save (with and without fsync) vs raw write + fsync.
* ``async_save``: time the caller is blocked by AsyncSaver vs Lightning's AsyncCheckpointIO vs DCP async_save
  vs a plain copy into a preallocated buffer (the floor).

Each script also runs on its own (``python benchmarks/<name>.py --help``) with its own flags and output.
"""
