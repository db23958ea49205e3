"""A simulated cluster driven by the real control and data planes (docs/simulation.md).

The driver, the executor, the TransferQueue and the worker runtimes run for real, with
hundreds of simulated ranks in a few host processes; only the device work inside each
worker call is simulated, by a cost model (``costs``) on a scaled clock (``clock``).
``cluster.simulate(ClusterConfig(...))`` runs one configuration; ``perf/simulate_cluster.py``
runs the paper's tables.
"""
