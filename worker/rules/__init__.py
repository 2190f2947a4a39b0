"""A job's rules that need no model: its prompt from messages and tools, tool calls read back, stop
strings, grammars (constrained decoding), and the one mapping from an exception to the job's
failure."""
