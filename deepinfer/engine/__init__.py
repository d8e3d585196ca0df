"""The loop: ``LLMEngine`` steps requests through the scheduler, the runner and the outputs; ``setup`` builds its parts."""
