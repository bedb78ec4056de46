"""Router role: the one public entry point; cheap CPU work and orchestration of E, P and D."""
