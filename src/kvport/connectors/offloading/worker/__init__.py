"""The OffloadingConnector's worker half (runs next to the model runner): runs the planned jobs on
transfer threads routed by (source, destination) medium, with deadlines."""
