"""dsv4-oracle: the command-line front end (``dsv4-oracle``) and the comparison engine shared by
the command and the pytest suite."""
