"""spec's tools beside the runtime: `bench` (spec bench, spec tune) and `convert` (spec convert). They use
the engine through engine.Engine, as any client does; the engine imports nothing of theirs."""
