// Renders Go text/template cases for tests/test_export_modelfile.py: reads a JSON list of
// {"template": string, "data": object} on stdin and writes a JSON list of {"out": string} or {"error": string}.
package main

import (
	"encoding/json"
	"os"
	"strings"
	"text/template"
)

type testCase struct {
	Template string         `json:"template"`
	Data     map[string]any `json:"data"`
}

type result struct {
	Out   string `json:"out"`
	Error string `json:"error,omitempty"`
}

func main() {
	var cases []testCase
	if err := json.NewDecoder(os.Stdin).Decode(&cases); err != nil {
		panic(err)
	}
	results := make([]result, len(cases))
	for i, c := range cases {
		tmpl, err := template.New("t").Parse(c.Template)
		if err != nil {
			results[i].Error = err.Error()
			continue
		}
		var b strings.Builder
		if err := tmpl.Execute(&b, c.Data); err != nil {
			results[i].Error = err.Error()
			continue
		}
		results[i].Out = b.String()
	}
	if err := json.NewEncoder(os.Stdout).Encode(results); err != nil {
		panic(err)
	}
}
