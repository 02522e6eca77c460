"""Not part of the sample project (tests/test_pytest_plugin.py copies everything else).

The sample is a user's project, run by tests/test_pytest_plugin.py in a directory of its
own against the built wheel; distlocks' own suite must not collect its tests.
"""

collect_ignore_glob = ["*"]
