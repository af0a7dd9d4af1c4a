"""The operator's command line, run as `python starter.py COMMAND`: a module per group of
commands (`runs`, `reconcile`, `schedule`, `customers`, `deployment`, `demo`), the command
table in `commands`, and `main`, which runs one command and says what went wrong in a line."""
