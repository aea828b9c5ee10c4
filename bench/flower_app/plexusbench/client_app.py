"""ClientApp: 'training' adds a constant to every received array; num-examples 100."""

from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

app = ClientApp()

DELTA = 0.001
NUM_EXAMPLES = 100


@app.train()
def train(msg: Message, context: Context) -> Message:
    arrays = msg.content["arrays"].to_numpy_ndarrays()
    # A site-specific constant, as Plexus' bench site adds: identical updates from several sites would be
    # deduplicated by Flower's content-addressed object store.
    delta = DELTA * (int(context.node_config.get("partition-id", 0)) + 1)
    for a in arrays:
        a += delta          # in place: the same trivial work Plexus' bench site does
    content = RecordDict({"arrays": ArrayRecord(arrays),
                          "metrics": MetricRecord({"num-examples": NUM_EXAMPLES})})
    return Message(content=content, reply_to=msg)
