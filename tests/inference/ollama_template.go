// Renders Ollama Modelfile templates with Go's own text/template, as Ollama does, for
// tests/inference/test_gguf_export.py (which builds and runs it when `go` is installed).
//
// stdin: {"template": "...", "cases": [{"system": "...", "messages": [{"role": "...", "content": "..."}]}]}
// stdout: a JSON list with each case's rendered prompt; a template Go refuses exits 1 with its error.
package main

import (
	"encoding/json"
	"fmt"
	"os"
	"strings"
	"text/template"
)

// Message and Values: the fields of Ollama's template values that our templates use
// (github.com/ollama/ollama, template.Values: .System, .Messages with .Role and .Content).
type Message struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

type Values struct {
	System   string    `json:"system"`
	Messages []Message `json:"messages"`
}

func main() {
	var input struct {
		Template string   `json:"template"`
		Cases    []Values `json:"cases"`
	}
	if err := json.NewDecoder(os.Stdin).Decode(&input); err != nil {
		fmt.Fprintln(os.Stderr, "bad input:", err)
		os.Exit(2)
	}
	tmpl, err := template.New("modelfile").Option("missingkey=error").Parse(input.Template)
	if err != nil {
		fmt.Fprintln(os.Stderr, "parse:", err)
		os.Exit(1)
	}
	out := []string{}
	for _, values := range input.Cases {
		var b strings.Builder
		if err := tmpl.Execute(&b, values); err != nil {
			fmt.Fprintln(os.Stderr, "execute:", err)
			os.Exit(1)
		}
		out = append(out, b.String())
	}
	json.NewEncoder(os.Stdout).Encode(out)
}
