"""slime runner: read slime job logs (logparse) and probe a training image's software stack (stack_probe)."""

from attune.runners.slime.logparse import CrashInfo, OomInfo, SlimeRun, format_summary, parse_slime_log
from attune.runners.slime.stack_probe import probe, stack_block

__all__ = ["CrashInfo", "OomInfo", "SlimeRun", "format_summary", "parse_slime_log", "probe", "stack_block"]
