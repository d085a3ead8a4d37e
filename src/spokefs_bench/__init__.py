"""spokefs's benchmarks and its demo: ``spokefs bench ...`` and ``spokefs demo``.

A package beside ``spokefs``, not inside it: the runtime (hub, spoke, mount, clients) never
imports it, and it imports the runtime like any user would. ``spokefs`` lists its commands
when it is installed (the ``bench`` extra brings what the plots and the training loader need).
"""
