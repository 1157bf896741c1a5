"""The lab's strategy (ansible.cfg): Ansible's own linear strategy, with Mitogen for hosts on a
local connection where Mitogen is installed.

Each task on such a host then runs in one Python interpreter the play keeps, instead of a new one
that imports Ansible's module code again: about 0.3 s of CPU a task, and a serve playbook runs
fifteen module tasks, a sweep two playbooks a point. Hosts reached over SSH keep Ansible's own ssh
connection, so an inventory's ssh_args (host keys, keep-alives that notice a vanished host) mean
what they say; Mitogen's action plugins step aside for them (its "mixed targets" mode).
"""
from ansible.plugins.strategy.linear import StrategyModule as Linear

try:
    import ansible_mitogen.strategy
except ImportError:  # Mitogen is not installed: Ansible's linear strategy as it is
    StrategyModule = Linear
else:
    ansible_mitogen.strategy.REDIRECTED_CONNECTION_PLUGINS = ("local",)

    class StrategyModule(ansible_mitogen.strategy.StrategyMixin, Linear):
        """Linear, with Mitogen's interpreter per host for local connections."""
