package main

import (
	"bufio"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
)

// TestMPICHLibPoll: libftkit-mpich.so makes an interrupted poll() without timeout wait again in
// hydra_pmi_proxy (CRIU's dump interrupts it; MPICH 4.0.2's proxy then never serves its ranks), and in no
// other program. The program waits in poll, gets a signal, and only then its input.
func TestMPICHLibPoll(t *testing.T) {
	if _, err := exec.LookPath("cc"); err != nil {
		t.Skip("SKIPPED: no C compiler (apt-get install gcc) to build libftkit-mpich.so and the test program")
	}
	dir := t.TempDir()
	lib := filepath.Join(dir, mpichLibName)
	if out, err := exec.Command("cc", "-shared", "-fPIC", "-O2", "-Wall", "-Werror", "-o", lib, "../../scripts/mpi/ftkit-mpich-finalize.c").CombinedOutput(); err != nil {
		t.Fatalf("build %s: %v\n%s", mpichLibName, err, out)
	}
	for _, c := range []struct {
		name, preload, want string
	}{
		{"hydra_pmi_proxy", lib, "ready"},
		{"hydra_pmi_proxy", "", "eintr"}, // what MPICH 4.0.2's proxy sees without the library
		{"orted", lib, "eintr"},          // any other program: the library changes nothing
	} {
		prog := filepath.Join(dir, c.name)
		if out, err := exec.Command("cc", "-O2", "-Wall", "-Werror", "-o", prog, "testdata/pollintr.c").CombinedOutput(); err != nil {
			t.Fatalf("build the test program: %v\n%s", err, out)
		}
		cmd := exec.Command(prog)
		cmd.Env = append(os.Environ(), "LD_PRELOAD="+c.preload)
		in, err := cmd.StdinPipe()
		if err != nil {
			t.Fatal(err)
		}
		outPipe, err := cmd.StdoutPipe()
		if err != nil {
			t.Fatal(err)
		}
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		out := bufio.NewScanner(outPipe)
		if !out.Scan() || out.Text() != "waiting" {
			t.Fatalf("%s: first line %q, want waiting", c.name, out.Text())
		}
		// It prints "waiting" before poll: wait until it sleeps in poll, so the signal interrupts it.
		for {
			b, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(cmd.Process.Pid), "wchan"))
			if err != nil {
				t.Fatal(err)
			}
			if strings.Contains(string(b), "poll") {
				break
			}
		}
		if err := cmd.Process.Signal(syscall.SIGUSR1); err != nil {
			t.Fatal(err)
		}
		if !out.Scan() || out.Text() != "signal" {
			t.Fatalf("%s: %q after the signal, want signal", c.name, out.Text())
		}
		in.Write([]byte("x\n"))
		in.Close()
		got := ""
		if out.Scan() {
			got = out.Text()
		}
		cmd.Wait()
		if got != c.want {
			t.Errorf("%s with LD_PRELOAD=%q: poll %s, want %s", c.name, c.preload, got, c.want)
		}
	}
}
