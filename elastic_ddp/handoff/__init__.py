"""What a node's torchrun agent and its workers hand each other (rounds, warm starts, verdicts, figures); standard library only."""
