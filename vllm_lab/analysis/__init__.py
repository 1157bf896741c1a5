"""What the recorded runs say, read from the store: the figures reports draw and commands decide on.

- ``points``: a point's figures over its repeats, the best point within noise, the Pareto front and
  the twin's recorded predictions;
- ``stress``: a staircase level's growth and the knee, a spike's recovery and a soak's drift;
- ``claims``: the guide's claims judged on a claims experiment's arms (and on the twin's
  predictions recorded with them);
- ``search``: a search's Optuna study: its trials, importances and best configurations;
- ``autotune``: an autotune's record (plan, candidates, minutes spent), each candidate's measured
  SLO capacity, the best and the verdict;
- ``findings``: the tuning guide's troubleshooting patterns in a run's figures;
- ``quarterly``: the tables of a period's report.

Nothing here draws or writes a file: ``reports`` does, from what these return.
"""
