package main

// The summary: one row per test, one column per runtime (run), from the
// harness's results file (run, test, exit code, seconds, and the exit code
// of the one retry a failed test gets, per line) and each test's `-test.v`
// logs (<test>.log, <test>.retry.log); printed, and written as markdown and JSON.

import (
	"bufio"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
)

type result struct {
	Run     string  `json:"run"`
	Test    string  `json:"test"`
	Status  string  `json:"status"` // pass, fail, flaky (failed, passed on retry), skip, timeout, none (not on this platform)
	Seconds float64 `json:"seconds"`
	Message string  `json:"message,omitempty"`
}

var (
	fileLine = regexp.MustCompile(`^\s+\S+\.go:\d+: `)
	panicRe  = regexp.MustCompile(`^panic: `)
)

// classify reads one test's log.
func classify(test string, rc int, log []string) (string, string) {
	var status, msg string
	for i, l := range log {
		switch {
		case strings.HasPrefix(l, "--- PASS: "+test+" "):
			status = "pass"
		case strings.HasPrefix(l, "--- SKIP: "+test+" "):
			// The t.Skip reason is printed just above.
			status = "skip"
			msg = lastFileLine(log, i)
		case strings.HasPrefix(l, "--- FAIL: "+test+" "):
			status = "fail"
		}
	}
	if rc == 124 || rc == 137 {
		return "timeout", lastFileLine(log, len(log))
	}
	if status == "" {
		for _, l := range log {
			if strings.Contains(l, "no tests to run") {
				return "none", ""
			}
		}
		status = "fail"
	}
	if status == "fail" {
		end := len(log)
		for i, l := range log {
			if strings.Contains(l, "--- FAIL: ") {
				end = i
				break
			}
		}
		msg = lastFileLine(log, end)
		for _, l := range log {
			if panicRe.MatchString(l) {
				msg = strings.TrimSpace(l)
				break
			}
		}
		if msg == "" {
			msg = fmt.Sprintf("exit %d, no test result (see the log)", rc)
		}
	}
	if status == "pass" {
		msg = ""
	}
	return status, msg
}

// lastFileLine is the last `file.go:N: message` line before end: the
// t.Fatal that ended the test, or the last t.Error.
func lastFileLine(log []string, end int) string {
	for i := end - 1; i >= 0; i-- {
		if fileLine.MatchString(log[i]) {
			m := strings.TrimSpace(log[i])
			if len(m) > 300 {
				m = m[:300] + "…"
			}
			return m
		}
	}
	return ""
}

func readLines(path string) []string {
	f, err := os.Open(path)
	if err != nil {
		return nil
	}
	defer f.Close()
	var out []string
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 1<<24)
	for sc.Scan() {
		out = append(out, sc.Text())
	}
	return out
}

func table(args []string) error {
	fs := flag.NewFlagSet("table", flag.ExitOnError)
	resultsPath := fs.String("results", "", "the harness's results file (run, test, rc, seconds; tab-separated)")
	logs := fs.String("logs", "", "the dir of <run>/<test>.log")
	mdPath := fs.String("md", "", "markdown output")
	jsonPath := fs.String("json", "", "JSON output")
	if err := fs.Parse(args); err != nil {
		return err
	}
	var results []result
	var runs, tests []string
	seenRun, seenTest := map[string]bool{}, map[string]bool{}
	byKey := map[string]*result{}
	for _, line := range readLines(*resultsPath) {
		f := strings.Split(line, "\t")
		if len(f) < 4 {
			continue
		}
		rc, _ := strconv.Atoi(f[2])
		secs, _ := strconv.ParseFloat(f[3], 64)
		status, msg := classify(f[1], rc, readLines(filepath.Join(*logs, f[0], f[1]+".log")))
		if len(f) > 4 && f[4] != "" && status == "fail" {
			retryRC, _ := strconv.Atoi(f[4])
			if again, _ := classify(f[1], retryRC, readLines(filepath.Join(*logs, f[0], f[1]+".retry.log"))); again == "pass" {
				status = "flaky"
			}
		}
		results = append(results, result{Run: f[0], Test: f[1], Status: status, Seconds: secs, Message: msg})
		if !seenRun[f[0]] {
			seenRun[f[0]] = true
			runs = append(runs, f[0])
		}
		if !seenTest[f[1]] {
			seenTest[f[1]] = true
			tests = append(tests, f[1])
		}
	}
	for i := range results {
		byKey[results[i].Run+"\t"+results[i].Test] = &results[i]
	}
	sort.Strings(tests)

	var md strings.Builder
	md.WriteString("| test | " + strings.Join(runs, " | ") + " |\n|---|" + strings.Repeat("---|", len(runs)) + "\n")
	for _, t := range tests {
		row := []string{t}
		for _, r := range runs {
			cell := "–"
			if res := byKey[r+"\t"+t]; res != nil {
				cell = res.Status
			}
			row = append(row, cell)
		}
		md.WriteString("| " + strings.Join(row, " | ") + " |\n")
	}
	md.WriteString("\n| run | pass | flaky | fail | timeout | skip | not on Linux | total s |\n|---|---|---|---|---|---|---|---|\n")
	for _, r := range runs {
		counts := map[string]int{}
		total := 0.0
		for _, res := range results {
			if res.Run == r {
				counts[res.Status]++
				total += res.Seconds
			}
		}
		fmt.Fprintf(&md, "| %s | %d | %d | %d | %d | %d | %d | %.0f |\n", r, counts["pass"], counts["flaky"], counts["fail"],
			counts["timeout"], counts["skip"], counts["none"], total)
	}
	// Every test whose result differs from the first run's (the reference),
	// with the message, and every failure of the reference itself.
	if len(runs) > 0 {
		ref := runs[0]
		fmt.Fprintf(&md, "\n### Not passing on %s (the reference)\n\n", ref)
		for _, t := range tests {
			if res := byKey[ref+"\t"+t]; res != nil && res.Status != "pass" && res.Status != "none" {
				fmt.Fprintf(&md, "- `%s` %s: %s\n", t, res.Status, res.Message)
			}
		}
		for i := 1; i < len(runs); i++ {
			prev := runs[i-1]
			fmt.Fprintf(&md, "\n### Differences %s → %s\n\n", prev, runs[i])
			for _, t := range tests {
				a, b := byKey[prev+"\t"+t], byKey[runs[i]+"\t"+t]
				if a == nil || b == nil || a.Status == b.Status {
					continue
				}
				fmt.Fprintf(&md, "- `%s` %s → %s: %s\n", t, a.Status, b.Status, b.Message)
			}
		}
	}
	fmt.Print(md.String())
	if *mdPath != "" {
		if err := os.WriteFile(*mdPath, []byte(md.String()), 0o644); err != nil {
			return err
		}
	}
	if *jsonPath != "" {
		data, err := json.MarshalIndent(map[string]interface{}{"runs": runs, "results": results}, "", "  ")
		if err != nil {
			return err
		}
		if err := os.WriteFile(*jsonPath, append(data, '\n'), 0o644); err != nil {
			return err
		}
	}
	return nil
}
