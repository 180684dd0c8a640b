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
		{"a running job here", []string{"1000", "100", "node2", "node1", ""}, "echo '101 1000'", 0, "-h --local -t R -w node2 -o %A %U", ""},
		{"no Slurm job id given", []string{"1000", "100", "node2", "node1"}, "echo '101 1000'", 0, "-h --local -t R -w node2 -o %A %U", ""},
		{"the given job among them", []string{"1000", "100", "node2", "node1", "102"}, "printf '101 1000\\n102 1000\\n'", 0, "-h --local -t R -w node2 -o %A %U", ""},
		{"root with a job here", []string{"0", "0", "node3", "node1", "7"}, "echo '7 0'", 0, "-h --local -t R -w node3 -o %A %U", ""},
		{"no running job here", []string{"1000", "100", "node2", "node1", "101"}, "true", 1, "-h --local -t R -w node2 -o %A %U",
			"uid 1000 has no running Slurm job on node2\n"},
		{"root without a job here", []string{"0", "0", "node2", "node1", ""}, "echo '101 1000'", 1, "-h --local -t R -w node2 -o %A %U",
			"uid 0 has no running Slurm job on node2\n"},
		{"another job of the user's", []string{"1000", "100", "node2", "node1", "103"}, "printf '101 1000\\n102 1000\\n103 1001\\n'", 1, "-h --local -t R -w node2 -o %A %U",
			"Slurm job 103 is not a running job of uid 1000 on node2 (its jobs there: 101 102)\n"},
		{"squeue fails", []string{"1000", "100", "node2", "node1", "101"}, "echo 'squeue: error: Unable to contact slurm controller' >&2; exit 1", 3,
			"-h --local -t R -w node2 -o %A %U", "squeue: error: Unable to contact slurm controller\nsqueue could not list uid 1000's running jobs on node2: refused\n"},
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

// TestSlurmStartJobScriptNumericUserName: Slurm reads squeue's -u as a user name first and as a uid only if no
// user has that name (uid_from_string), and sites with directories of numeric login names (student ids)
// have users named like another user's uid. The uid the agent passes must pick the user's own jobs, never
// those of a user whose name is that number: here user "1001" has uid 5000, and uid 1001 is someone else.
func TestSlurmStartJobScriptNumericUserName(t *testing.T) {
	dir := t.TempDir()
	script := filepath.Join(dir, "ftkit-start-job-slurm")
	if err := os.WriteFile(script, SlurmStartJobScript, 0o755); err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(dir, "bin")
	if err := os.Mkdir(bin, 0o755); err != nil {
		t.Fatal(err)
	}
	// A squeue over one table of running jobs (id, uid, node), with -u, -w and -o %A / "%A %U" as Slurm has them.
	fake := `#!/bin/sh
user= host= fmt=
while [ $# -gt 0 ]; do
	case $1 in
	-u) user=$2; shift ;;
	-w) host=$2; shift ;;
	-o) fmt=$2; shift ;;
	esac
	shift
done
uid=$user
[ "$user" = 1001 ] && uid=5000 # the user named "1001"
while read -r id juid jhost; do
	[ "$jhost" = "$host" ] || continue
	[ -z "$user" ] || [ "$juid" = "$uid" ] || continue
	case $fmt in
	%A) echo "$id" ;;
	"%A %U") echo "$id $juid" ;;
	*) echo "fake squeue: format $fmt" >&2; exit 1 ;;
	esac
done <<END
101 5000 node2
102 1001 node3
END
`
	if err := os.WriteFile(filepath.Join(bin, "squeue"), []byte(fake), 0o755); err != nil {
		t.Fatal(err)
	}
	t.Setenv("PATH", bin+":/usr/bin:/bin")
	for _, tc := range []struct {
		name string
		args []string
		exit int
	}{
		{"uid 1001 where only user 1001 (uid 5000) runs", []string{"1001", "100", "node2", "node1", ""}, 1},
		{"uid 1001 naming user 1001's job", []string{"1001", "100", "node2", "node1", "101"}, 1},
		{"uid 1001 on its own job's host", []string{"1001", "100", "node3", "node1", "102"}, 0},
		{"user 1001 (uid 5000) on its job's host", []string{"5000", "100", "node2", "node1", "101"}, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := sitecmd.Command{Name: "start-job command", Argv: append([]string{script}, tc.args...), Timeout: time.Minute, KeepStderr: true}.Run(context.Background())
			if r.Exit != tc.exit {
				t.Errorf("exit %d (%v), want %d; stderr %q", r.Exit, r.Err, tc.exit, r.Stderr)
			}
		})
	}
}

// TestSlurmStartJobScriptFederation: a cluster of a Slurm federation with FederationParameters=fed_display
// has squeue show the running jobs of every sibling cluster, whose node names are their own ("node2" is a
// node of each), unless --local is given. A user whose running job is on another cluster's node2 must not be
// admitted on this cluster's node2, where Slurm gave them nothing.
func TestSlurmStartJobScriptFederation(t *testing.T) {
	dir := t.TempDir()
	script := filepath.Join(dir, "ftkit-start-job-slurm")
	if err := os.WriteFile(script, SlurmStartJobScript, 0o755); err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(dir, "bin")
	if err := os.Mkdir(bin, 0o755); err != nil {
		t.Fatal(err)
	}
	// A squeue over the running jobs (id, uid, cluster, node) of a federation displayed by default, with
	// -w, --local and -o "%A %U" as Slurm has them.
	fake := `#!/bin/sh
host= local=
while [ $# -gt 0 ]; do
	case $1 in
	-w) host=$2; shift ;;
	--local) local=1 ;;
	esac
	shift
done
while read -r id juid jcluster jhost; do
	[ "$jhost" = "$host" ] || continue
	[ -z "$local" ] || [ "$jcluster" = this ] || continue
	echo "$id $juid"
done <<END
101 1000 sibling node2
102 1001 this node2
103 1000 this node3
END
`
	if err := os.WriteFile(filepath.Join(bin, "squeue"), []byte(fake), 0o755); err != nil {
		t.Fatal(err)
	}
	t.Setenv("PATH", bin+":/usr/bin:/bin")
	for _, tc := range []struct {
		name string
		args []string
		exit int
	}{
		{"a job on the sibling cluster's node of the same name", []string{"1000", "100", "node2", "node1", ""}, 1},
		{"naming that job", []string{"1000", "100", "node2", "node1", "101"}, 1},
		{"a job on this cluster's node", []string{"1001", "100", "node2", "node1", "102"}, 0},
		{"the user's own job here", []string{"1000", "100", "node3", "node1", "103"}, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := sitecmd.Command{Name: "start-job command", Argv: append([]string{script}, tc.args...), Timeout: time.Minute, KeepStderr: true}.Run(context.Background())
			if r.Exit != tc.exit {
				t.Errorf("exit %d (%v), want %d; stderr %q", r.Exit, r.Err, tc.exit, r.Stderr)
			}
		})
	}
}
