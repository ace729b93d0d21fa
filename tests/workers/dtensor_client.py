"""A DTensor multi-client test worker: experiments.train's own flags, plus every
client's final weights.

    tfdist launch --workers 2 --devices_per_worker 2 --dtensor -- \
        python tests/workers/dtensor_client.py --weights_prefix=OUT --strategy=dtensor ...

Builds the RunConfig exactly as `python -m experiments.train` does from the same
flags and trains it with tfdist's runner; then client C writes its final weights
(gathered: Model.get_weights(), a collective every client joins in the same
order) to OUT.clientC.npz, so a test can compare each client with one device,
and waits at a barrier until every client has.
"""

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from absl import app, flags  # noqa: E402

from experiments import train as train_cli  # noqa: E402  (defines the flags)
from tfdist.train import runner  # noqa: E402

flags.DEFINE_string("weights_prefix", None, "Client C writes PREFIX.clientC.npz.", required=True)


def main(argv):
    del argv
    _, model = runner.run(train_cli.config_from_flags(), return_model=True)
    client = os.environ["DTENSOR_CLIENT_ID"]
    np.savez(f"{flags.FLAGS.weights_prefix}.client{client}.npz", *model.get_weights())
    # The gathers are collectives: a client that finished its part and exited took
    # the coordination service with it while the other still read (measured: the
    # peer's last gather was cancelled). Nobody leaves before everyone has its weights.
    from tensorflow.experimental import dtensor
    dtensor.barrier(dtensor.fetch_layout(model.weights[0].value).mesh, "weights written",
                    timeout_in_ms=120_000)


if __name__ == "__main__":
    app.run(main)
