# The minimal Python guard of the README: cancels file deletions and masks
# passwords (as a mutate guard); a call whose arguments it cannot read is
# steered, never let through unjudged. Run:
#   python guards/python/examples/no_delete.py --port 0 \
#       --mesh 127.0.0.1:50051 --role mutate --grant-tools '*'
import json

from guardmesh import guard as gg


def judge(batch):
    for call in batch.calls:
        try:
            args = json.loads(call.arguments.strip() or "{}")
        except (ValueError, RecursionError):
            args = None
        if call.tool == "fs.delete":
            yield gg.cancel(call.call_id, "Deleting files is not allowed.")
        elif not isinstance(args, dict):  # cannot read it, so cannot judge it
            yield gg.steer(call.call_id, "The arguments are not a JSON object; fix them and retry.")
        elif "password" in args:
            yield gg.rewrite(call.call_id, arguments={**args, "password": "***"})


if __name__ == "__main__":
    gg.main(judge, name="no-delete")
