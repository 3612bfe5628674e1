"""Fault scenarios run many times against ranksafe on real ranks; see ``python -m chaos --help``."""
