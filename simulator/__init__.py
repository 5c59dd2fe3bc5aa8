"""The discrete-event simulator: a simpy engine over the policies/ scheduler and cost models."""
