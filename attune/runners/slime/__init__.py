"""slime runner: the launch (launch), job logs (logparse), the cluster file (cluster), Ray jobs (jobs) and the
image's software stack (stack_probe, run on the nodes as ``python3 -m attune.runners.slime.stack_probe``).

Only the log parser is re-exported here; stack_probe is not imported by the package, so running it with
``python3 -m`` does not import it twice.
"""

from attune.runners.slime.logparse import CrashInfo, OomInfo, SlimeRun, format_summary, parse_slime_log

__all__ = ["CrashInfo", "OomInfo", "SlimeRun", "format_summary", "parse_slime_log"]
