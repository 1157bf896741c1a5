"""The lab's strategy (ansible.cfg): Ansible's own linear strategy, with Mitogen for hosts on a
local connection where Mitogen is installed.

Each task on such a host then runs in one Python interpreter the play keeps, instead of a new one
that imports Ansible's module code again: about 0.3 s of CPU a task, and a serve playbook runs
fifteen module tasks, a sweep two playbooks a point. Hosts reached over SSH keep Ansible's own ssh
connection, so an inventory's ssh_args (host keys, keep-alives that notice a vanished host) mean
what they say; Mitogen's action plugins step aside for them (its "mixed targets" mode).

Either way the controller loads the Jinja filter and test plugins before it forks a task's worker:
each worker otherwise loads them all again, the vllm role's filters importing the lab with them
(about 25 ms of CPU a task).
"""
from ansible.plugins.loader import filter_loader, test_loader
from ansible.plugins.strategy.linear import StrategyModule as Linear


class _WarmJinjaPlugins:
    """Loads the Jinja plugins in the controller (again after a role adds its folders) so every
    worker forked for a task inherits them."""

    def _queue_task(self, host, task, task_vars, play_context):
        for loader in (filter_loader, test_loader):
            for _ in loader.all():  # cached after the first call; a role's new folder clears it
                break
        return super()._queue_task(host, task, task_vars, play_context)


try:
    import ansible_mitogen.strategy
except ImportError:  # Mitogen is not installed: Ansible's linear strategy as it is
    class StrategyModule(_WarmJinjaPlugins, Linear):
        """Linear, its Jinja plugins loaded once in the controller."""
else:
    ansible_mitogen.strategy.REDIRECTED_CONNECTION_PLUGINS = ("local",)

    class StrategyModule(_WarmJinjaPlugins, ansible_mitogen.strategy.StrategyMixin, Linear):
        """Linear, with Mitogen's interpreter per host for local connections."""
