"""The lab's commands, one module each; ``cli`` parses a command line and calls one of them.

The long commands take runs: ``baseline`` (step 1), ``sweep`` (step 2), ``combo`` and ``tune``
(step 3), ``stress`` (step 4), ``claims``, ``calibrate`` and ``autotune``. Each names its
experiment (``naming``), builds its points and takes them through ``experiment.Experiment`` or its
own loop, always within ``stopping.take``: the one place where the deadline and Ctrl-C stop a
command, with its servers stopped, its finished runs kept and the command that resumes it.
``settings`` is what they all take (``Source``, ``Settings``), ``arguments`` the options they share,
``backend`` the backend they measure on, ``precision`` the rounds PRECISION= asks for.

The others read or look after what is there: ``lint``, ``show``, ``report`` (and the quarterly
report), ``status``, ``findings``, ``watch``, ``monitor``, ``hosts`` (provision, stop, teardown)
and ``bench``.
"""
