"""attune runners: where a trial runs and what runs there.

``attune.runners.base`` holds the contract (Runner, TrialSpec, TrialResult, Capabilities, step_time_stats);
``attune.runners.registry`` names the concrete runners (get_runner, runner_names, runner_capabilities).
"""
