"""What both servers run: model forward, weight loading, KV layout and pool, sampling, transports."""
