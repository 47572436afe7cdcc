"""What both servers share around the engine: flags and config, gRPC plumbing, start-up, request checks."""
