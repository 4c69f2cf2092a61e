"""The commands (floor 5): ``dipaco``, ``dipaco-coordinator``, ``dipaco-peer``. They parse
arguments, call one function below and print; nothing imports them."""
