package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// TestLauncherScriptQuotesFtctlPath: the run directory's rsh script, which MPI runs for every remote
// daemon, execs this ftctl whatever its path holds (a quote, a space, a dollar): a path with a quote
// broke the script's quoting, and every daemon's launch failed, or ran what the rest of the path named.
func TestLauncherScriptQuotesFtctlPath(t *testing.T) {
	for _, name := range []string{"plain", "it's here", "a $HOME `x` \"y\""} {
		t.Run(name, func(t *testing.T) {
			bin := filepath.Join(t.TempDir(), name)
			if err := os.Mkdir(bin, 0o755); err != nil {
				t.Fatal(err)
			}
			// A stand-in ftctl that prints the words it was given, one a line.
			self := filepath.Join(bin, "ftctl")
			if err := os.WriteFile(self, []byte("#!/bin/sh\nprintf '%s\\n' \"$@\"\n"), 0o755); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(filepath.Join(bin, mpichLibName), []byte("lib"), 0o644); err != nil {
				t.Fatal(err)
			}
			f := &mpiRunFlags{impl: "mpich", mpirun: "true", eagerOnly: true}
			p := &mpiPlan{ranks: []string{"node1", "node2"}, dir: t.TempDir(), cidrs: "10.0.0.0/24"}
			if _, err := f.launcherArgv(p, self, []string{"ring"}); err != nil {
				t.Fatal(err)
			}
			out, err := exec.Command("/bin/sh", filepath.Join(p.dir, "rsh"), "node2", "orted", "-x").CombinedOutput()
			if got, want := string(out), "mpirun\nlaunch-daemon\nnode2\norted\n-x\n"; err != nil || got != want {
				t.Errorf("the rsh script with ftctl at %q: %v, printed %q; want %q", self, err, got, want)
			}
			if b, _ := os.ReadFile(filepath.Join(p.dir, "rsh")); !strings.HasPrefix(string(b), "#!/bin/sh\n") {
				t.Errorf("the rsh script %q is not a shell script", b)
			}
		})
	}
}
