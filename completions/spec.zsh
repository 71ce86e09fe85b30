
#compdef spec

_spec_completion() {
  eval $(env _TYPER_COMPLETE_ARGS="${words[1,$CURRENT]}" _SPEC_COMPLETE=complete_zsh spec)
}

compdef _spec_completion spec

