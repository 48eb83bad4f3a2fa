// An MCP server for the gateway's tests that reads JSON-RPC the way Go
// programs do: each line of stdin decoded with encoding/json into structs,
// whose member names match case-insensitively (Unicode simple folding; of
// two members that fold alike, the last one wins). Three tools, as in
// upstream.py: delete_file, pay, read_file. Every call it executes is
// appended to LOG as one JSON line {"tool": ..., "arguments": ...}.
//
// Usage: upstream LOG     an MCP server on stdio
//
//	upstream decode  for each line of stdin (a JSON-RPC message),
//	                 prints one line: what Go reads in it (the property
//	                 test's decoder)
//	upstream fold    for each line of stdin (a string), prints the
//	                 name Go's encoding/json matches it by, as JSON
package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"unicode"
	"unicode/utf8"
)

type request struct {
	JSONRPC string          `json:"jsonrpc"`
	ID      json.RawMessage `json:"id"`
	Method  string          `json:"method"`
	Params  json.RawMessage `json:"params"`
}

type callParams struct {
	Name      string          `json:"name"`
	Arguments json.RawMessage `json:"arguments"`
}

type pathArgs struct {
	Path string `json:"path"`
}

type payArgs struct {
	Amount float64 `json:"amount"`
	To     string  `json:"to"`
}

// The argument members the property test draws, as a Go tool would declare them.
type knownArgs struct {
	Path   any `json:"path"`
	To     any `json:"to"`
	Amount any `json:"amount"`
	Mask   any `json:"mask"`
}

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: upstream LOG | decode | fold")
		os.Exit(2)
	}
	in := bufio.NewReaderSize(os.Stdin, 1<<20)
	out := bufio.NewWriter(os.Stdout)
	switch os.Args[1] {
	case "decode":
		lines(in, func(line []byte) { decode(out, line) })
	case "fold":
		lines(in, func(line []byte) {
			var s string
			_ = json.Unmarshal(line, &s)
			b, _ := json.Marshal(fold(s))
			out.Write(append(b, '\n'))
			out.Flush()
		})
	default:
		serve(os.Args[1], in, out)
	}
}

func lines(in *bufio.Reader, each func([]byte)) {
	for {
		line, err := in.ReadBytes('\n')
		line = bytes.TrimRight(line, "\r\n")
		if len(line) > 0 {
			each(line)
		}
		if err != nil {
			return
		}
	}
}

// fold is encoding/json's foldName (Go 1.21), written out because Go 1.19
// compares with bytes.EqualFold instead: the same relation.
func fold(s string) string {
	var out []rune
	for _, r := range s {
		if r < utf8.RuneSelf {
			if 'a' <= r && r <= 'z' {
				r -= 'a' - 'A'
			}
			out = append(out, r)
			continue
		}
		for {
			r2 := unicode.SimpleFold(r)
			if r2 <= r {
				r = r2
				break
			}
			r = r2
		}
		out = append(out, r)
	}
	return string(out)
}

func decode(out *bufio.Writer, line []byte) {
	if bytes.HasPrefix(line, []byte(`{"sentinel":`)) {
		// The test's marker between cases: echoed.
		out.Write(append(line, '\n'))
		out.Flush()
		return
	}
	view := map[string]any{}
	var req request
	if err := json.Unmarshal(line, &req); err != nil {
		view["error"] = err.Error()
	} else {
		view["method"] = req.Method
		view["id"] = raw(req.ID)
		var params callParams
		if len(req.Params) > 0 && json.Unmarshal(req.Params, &params) == nil {
			view["name"] = params.Name
			var args map[string]any
			if json.Unmarshal(params.Arguments, &args) == nil {
				view["arguments"] = args
			}
			var known knownArgs
			if json.Unmarshal(params.Arguments, &known) == nil {
				view["known"] = known
			}
		}
	}
	b, _ := json.Marshal(view)
	out.Write(append(b, '\n'))
	out.Flush()
}

func raw(m json.RawMessage) any {
	var v any
	if len(m) == 0 || json.Unmarshal(m, &v) != nil {
		return nil
	}
	return v
}

func serve(logPath string, in *bufio.Reader, out *bufio.Writer) {
	send := func(v any) {
		b, _ := json.Marshal(v)
		out.Write(append(b, '\n'))
		out.Flush()
	}
	record := func(tool string, args any) {
		f, err := os.OpenFile(logPath, os.O_APPEND|os.O_CREATE|os.O_WRONLY, 0o644)
		if err != nil {
			return
		}
		b, _ := json.Marshal(map[string]any{"tool": tool, "arguments": args})
		f.Write(append(b, '\n'))
		f.Close()
	}
	text := func(id json.RawMessage, s string, isError bool) {
		send(map[string]any{"jsonrpc": "2.0", "id": id, "result": map[string]any{
			"content": []any{map[string]any{"type": "text", "text": s}}, "isError": isError}})
	}
	lines(in, func(line []byte) {
		var req request
		if err := json.Unmarshal(line, &req); err != nil {
			send(map[string]any{"jsonrpc": "2.0", "id": nil, "error": map[string]any{"code": -32700, "message": err.Error()}})
			return
		}
		if len(req.ID) == 0 {
			return // a notification
		}
		switch req.Method {
		case "initialize":
			send(map[string]any{"jsonrpc": "2.0", "id": req.ID, "result": map[string]any{
				"protocolVersion": "2025-11-25", "capabilities": map[string]any{"tools": map[string]any{}},
				"serverInfo": map[string]any{"name": "guardmesh-test-upstream-go", "version": "0"}}})
		case "ping":
			send(map[string]any{"jsonrpc": "2.0", "id": req.ID, "result": map[string]any{}})
		case "tools/list":
			schema := func(props ...string) map[string]any {
				p := map[string]any{}
				for _, name := range props {
					p[name] = map[string]any{"type": "string"}
				}
				return map[string]any{"type": "object", "properties": p}
			}
			send(map[string]any{"jsonrpc": "2.0", "id": req.ID, "result": map[string]any{"tools": []any{
				map[string]any{"name": "delete_file", "inputSchema": schema("path")},
				map[string]any{"name": "pay", "inputSchema": schema("amount", "to")},
				map[string]any{"name": "read_file", "inputSchema": schema("path")},
			}}})
		case "tools/call":
			var params callParams
			if err := json.Unmarshal(req.Params, &params); err != nil {
				text(req.ID, err.Error(), true)
				return
			}
			switch params.Name {
			case "delete_file", "read_file":
				var args pathArgs
				if err := json.Unmarshal(params.Arguments, &args); err != nil {
					text(req.ID, err.Error(), true)
					return
				}
				record(params.Name, args)
				if params.Name == "delete_file" {
					text(req.ID, "deleted "+args.Path, false)
				} else {
					text(req.ID, "contents of "+args.Path, false)
				}
			case "pay":
				var args payArgs
				if err := json.Unmarshal(params.Arguments, &args); err != nil {
					text(req.ID, err.Error(), true)
					return
				}
				record("pay", args)
				text(req.ID, fmt.Sprintf("paid %v to %s", args.Amount, args.To), false)
			default:
				text(req.ID, "unknown tool "+params.Name, true)
			}
		default:
			send(map[string]any{"jsonrpc": "2.0", "id": req.ID, "error": map[string]any{"code": -32601, "message": "method not found"}})
		}
	})
}
