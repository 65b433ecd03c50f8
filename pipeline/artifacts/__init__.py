"""Typed readers (and writers) of the artifact contracts in docs/architecture.md, one small module per stage's
artifact. Every consumer (a later stage, `specpipe monitor`, `specpipe profile`) reads another stage's files only
through these, so a file's parsing and its row rules live in one place; the producing stage writes through the
same module where the contract has more than one reader.

Each reader takes the artifact's directory (`Artifact.path`, or `<workdir>/artifacts/<stage>`) and raises
`StageError` naming the file when the contract is broken. No heavy imports at module level."""
