# The minimal Python guard of the README: cancels file deletions and masks
# passwords (as a mutate guard). Run:
#   build/venv/bin/python guards/python/examples/no_delete.py --port 0 \
#       --mesh 127.0.0.1:50051 --role mutate --grant-tools '*'
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # guards/python
import guardmesh_guard as gg  # noqa: E402


def judge(batch):
    for call in batch.calls:
        if call.tool == "fs.delete":
            yield gg.cancel(call.call_id, "Deleting files is not allowed.")
        elif "password" in call.args:
            yield gg.rewrite(call.call_id, arguments={**call.args, "password": "***"})


if __name__ == "__main__":
    gg.main(judge, name="no-delete")
