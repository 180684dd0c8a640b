package deploy

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/ftkit/ftkit/internal/sitecmd"
)

// TestSlurmStartJobScript runs the shipped start-job command for Slurm sites as the agent runs it
// (package sitecmd: PATH as its only environment, standard error kept apart) against a fake squeue. It
// admits a user only where squeue lists a running job of the user's on this host, and a given Slurm job id
// only if it is one of them; it refuses when squeue fails (fail closed), and refuses arguments that are no
// uid, node name or job id before it asks squeue anything. Root is no exception.
func TestSlurmStartJobScript(t *testing.T) {
	disk, err := os.ReadFile("slurm/ftkit-start-job-slurm")
	if err != nil || !bytes.Equal(disk, SlurmStartJobScript) {
		t.Fatalf("the embedded script is not slurm/ftkit-start-job-slurm (%v)", err)
	}
	dir := t.TempDir()
	script := filepath.Join(dir, "ftkit-start-job-slurm")
	if err := os.WriteFile(script, SlurmStartJobScript, 0o755); err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(dir, "bin")
	if err := os.Mkdir(bin, 0o755); err != nil {
		t.Fatal(err)
	}
	record := filepath.Join(dir, "squeue.args")
	t.Setenv("PATH", bin+":/usr/bin:/bin")
	for _, tc := range []struct {
		name   string
		args   []string
		squeue string // the fake squeue's body after it records its arguments
		exit   int
		asked  string // squeue's arguments; "": not run
		stderr string // the start of the script's standard error
	}{
		{"a running job here", []string{"1000", "100", "node2", "node1", ""}, "echo 101", 0, "-h -t R -u 1000 -w node2 -o %A", ""},
		{"no Slurm job id given", []string{"1000", "100", "node2", "node1"}, "echo 101", 0, "-h -t R -u 1000 -w node2 -o %A", ""},
		{"the given job among them", []string{"1000", "100", "node2", "node1", "102"}, "printf '101\\n102\\n'", 0, "-h -t R -u 1000 -w node2 -o %A", ""},
		{"root with a job here", []string{"0", "0", "node3", "node1", "7"}, "echo 7", 0, "-h -t R -u 0 -w node3 -o %A", ""},
		{"no running job here", []string{"1000", "100", "node2", "node1", "101"}, "true", 1, "-h -t R -u 1000 -w node2 -o %A",
			"uid 1000 has no running Slurm job on node2\n"},
		{"root without a job here", []string{"0", "0", "node2", "node1", ""}, "true", 1, "-h -t R -u 0 -w node2 -o %A",
			"uid 0 has no running Slurm job on node2\n"},
		{"another job of the user's", []string{"1000", "100", "node2", "node1", "103"}, "printf '101\\n102\\n'", 1, "-h -t R -u 1000 -w node2 -o %A",
			"Slurm job 103 is not a running job of uid 1000 on node2 (its jobs there: 101 102)\n"},
		{"squeue fails", []string{"1000", "100", "node2", "node1", "101"}, "echo 'squeue: error: Unable to contact slurm controller' >&2; exit 1", 3,
			"-h -t R -u 1000 -w node2 -o %A", "squeue: error: Unable to contact slurm controller\nsqueue could not list uid 1000's running jobs on node2: refused\n"},
		{"a uid that is no number", []string{"-1", "100", "node2", "node1"}, "echo 101", 2, "", "uid '-1' is not a number\n"},
		{"a host that is an option", []string{"1000", "100", "-wnode9", "node1"}, "echo 101", 2, "", "host '-wnode9' is not a Slurm node name\n"},
		{"a job id that is no number", []string{"1000", "100", "node2", "node1", "101,102"}, "echo 101", 2, "", "SLURM_JOB_ID '101,102' is not a Slurm job id\n"},
		{"too few arguments", []string{"1000", "100", "node2"}, "echo 101", 2, "", "usage: ftkit-start-job-slurm UID GID HOST PEER [SLURM_JOB_ID]; got 3 arguments\n"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			os.Remove(record)
			fake := "#!/bin/sh\necho \"$*\" > '" + record + "'\n" + tc.squeue + "\n"
			if err := os.WriteFile(filepath.Join(bin, "squeue"), []byte(fake), 0o755); err != nil {
				t.Fatal(err)
			}
			r := sitecmd.Command{Name: "start-job command", Argv: append([]string{script}, tc.args...), Timeout: time.Minute, KeepStderr: true}.Run(context.Background())
			if r.Exit != tc.exit {
				t.Errorf("exit %d (%v), want %d; stderr %q", r.Exit, r.Err, tc.exit, r.Stderr)
			}
			if r.Stderr != tc.stderr {
				t.Errorf("stderr %q, want %q", r.Stderr, tc.stderr)
			}
			asked, _ := os.ReadFile(record)
			if got := strings.TrimSuffix(string(asked), "\n"); got != tc.asked {
				t.Errorf("squeue asked with %q, want %q", got, tc.asked)
			}
		})
	}
}

// The package installs the script where the documentation and the example configuration say, executable:
// the agent runs only a program root alone can change, which dpkg makes it.
func TestPackageShipsSlurmStartJobScript(t *testing.T) {
	b, err := os.ReadFile("nfpm.yaml")
	if err != nil {
		t.Fatal(err)
	}
	entry := regexp.MustCompile(`(?m)^  - src: deploy/slurm/ftkit-start-job-slurm\n    dst: ` + regexp.QuoteMeta(SlurmStartJobPath) + `\n    file_info: \{mode: 0755\}$`)
	if !entry.Match(b) {
		t.Errorf("nfpm.yaml does not install deploy/slurm/ftkit-start-job-slurm at %s with mode 0755", SlurmStartJobPath)
	}
	for _, doc := range []string{"../docs/deploy.md", "../docs/agent.example.toml"} {
		if b, err := os.ReadFile(doc); err != nil || !bytes.Contains(b, []byte(SlurmStartJobPath)) {
			t.Errorf("%s does not name %s (%v)", doc, SlurmStartJobPath, err)
		}
	}
}
