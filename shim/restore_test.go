package shim

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ftkit/ftkit/criu"
	"github.com/ftkit/ftkit/internal/testenv"
)

// The test binary plays the shim (shimRole: Run on its standard input and output) and the job
// (holderRole: holds the file holdEnv names open for reading, says so in readyEnv's file, sleeps).
const (
	roleEnv    = "FTKIT_SHIM_TEST_ROLE"
	shimRole   = "shim"
	holderRole = "holder"
	holdEnv    = "FTKIT_HOLD"
	readyEnv   = "FTKIT_READY"
)

func TestMain(m *testing.M) {
	switch os.Getenv(roleEnv) {
	case shimRole:
		os.Exit(Run(context.Background(), os.Stdin, os.Stdout))
	case holderRole:
		f, err := os.Open(os.Getenv(holdEnv))
		if err == nil {
			err = os.WriteFile(os.Getenv(readyEnv), nil, 0o600)
		}
		if err != nil {
			os.Exit(1)
		}
		defer f.Close()
		select {}
	}
	os.Exit(m.Run())
}

// A job of uid 65534 that had its own file "data" open is dumped; its user then swaps "data" for a link to
// root's secret of the same size and mode (all CRIU compares) in a directory the user cannot search.
// CRIU, as root, follows the link: the old shim handed the restored job a descriptor of the secret. Now the
// restore is refused, and the same snapshot restores once "data" is back.
func TestRestoreRefusesSwappedFile(t *testing.T) {
	testenv.RequireKernel(t, "CRIU")
	bin, _, err := criu.Require("")
	if err != nil {
		t.Fatal(err)
	}
	const user = 65534
	dir, err := os.MkdirTemp("/tmp", "shimrestore-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(os.Chmod(dir, 0o755))
	data, secret := filepath.Join(dir, "data"), filepath.Join(dir, "closed", "secret")
	must(os.Mkdir(filepath.Dir(secret), 0o700))
	must(os.WriteFile(data, make([]byte, 8192), 0o600))
	must(os.Chown(data, user, user))
	must(os.WriteFile(secret, []byte(strings.Repeat("s", 8192)), 0o600))
	// The job's program where its user can reach it: its mapping is checked like any file.
	self, err := os.Executable()
	must(err)
	b, err := os.ReadFile(self)
	must(err)
	exe := filepath.Join(dir, "job")
	must(os.WriteFile(exe, b, 0o755))

	ready := filepath.Join(dir, "ready")
	job := exec.Command(exe)
	job.Dir = dir
	job.Env = append(os.Environ(), roleEnv+"="+holderRole, holdEnv+"="+data, readyEnv+"="+ready)
	job.SysProcAttr = &syscall.SysProcAttr{Setsid: true, Cloneflags: syscall.CLONE_NEWPID}
	must(job.Start())
	t.Cleanup(func() { job.Process.Kill(); job.Wait() })
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if _, err := os.Stat(ready); err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the job did not open its file within 30s")
		}
	}
	images := filepath.Join(dir, "images")
	must(os.Mkdir(images, 0o700))
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	if _, err := (criu.Client{Binary: bin}).Dump(ctx, criu.DumpOptions{PID: job.Process.Pid, ImagesDir: images}); err != nil {
		t.Fatal(err)
	}
	job.Wait() // killed by the dump

	must(os.Rename(data, data+".orig"))
	must(os.Symlink(secret, data))
	rep := restoreWithShim(t, Spec{JobID: "j", Mode: ModeRestore, CRIU: bin, ImagesDir: images, UID: user, GID: user,
		ExitFile: filepath.Join(dir, "exit"), Node: "n"})
	if rep.PID != 0 {
		var held []string
		fds, _ := os.ReadDir(fmt.Sprintf("/proc/%d/fd", rep.PID))
		for _, fd := range fds {
			l, _ := os.Readlink(fmt.Sprintf("/proc/%d/fd/%s", rep.PID, fd.Name()))
			held = append(held, fd.Name()+" "+l)
		}
		t.Fatalf("the restore of a job whose file was swapped for a link to root's secret succeeded (pid %d, descriptors: %s)", rep.PID, strings.Join(held, ", "))
	}
	if !strings.Contains(rep.Error, "could not open itself") || !strings.Contains(rep.Error, secret) {
		t.Fatalf("the restore failed with %q, want the check's refusal naming %s", rep.Error, secret)
	}
	t.Logf("refused: %s", rep.Error)

	must(os.Remove(data))
	must(os.Rename(data+".orig", data))
	rep = restoreWithShim(t, Spec{JobID: "j", Mode: ModeRestore, CRIU: bin, ImagesDir: images, UID: user, GID: user,
		ExitFile: filepath.Join(dir, "exit"), Node: "n"})
	if rep.PID == 0 {
		t.Fatalf("the restore with the job's file back failed: %s", rep.Error)
	}
}

// restoreWithShim runs the shim on spec and returns its report; a restored job is killed when the test ends.
func restoreWithShim(t *testing.T, spec Spec) Report {
	t.Helper()
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	in, err := json.Marshal(spec)
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(self)
	cmd.Env = append(os.Environ(), roleEnv+"="+shimRole)
	cmd.Stdin = strings.NewReader(string(in))
	cmd.Stderr = os.Stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	line, err := bufio.NewReader(out).ReadString('\n')
	var rep Report
	if jerr := json.Unmarshal([]byte(line), &rep); err != nil || jerr != nil {
		cmd.Process.Kill()
		cmd.Wait()
		t.Fatalf("shim report %q: %v %v", line, err, jerr)
	}
	t.Cleanup(func() {
		if rep.PID != 0 {
			syscall.Kill(rep.PID, syscall.SIGKILL)
		}
		cmd.Wait() // the shim ends with its job
	})
	return rep
}

// A job's user swaps its file for a link to /proc/PID/fd/N of a root process holding a deleted root-only file
// of the same size and mode: CRIU, as root, follows the link and the magic link behind it, and the restored
// job would hold a file with no name left, which the check must not take for one CRIU made from the snapshot.
func TestRestoreRefusesLinkToDeletedFile(t *testing.T) {
	testenv.RequireKernel(t, "CRIU")
	bin, _, err := criu.Require("")
	if err != nil {
		t.Fatal(err)
	}
	const user = 65534
	dir, err := os.MkdirTemp("/tmp", "shimrestore-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(os.Chmod(dir, 0o755))
	data := filepath.Join(dir, "data")
	must(os.WriteFile(data, make([]byte, 8192), 0o600))
	must(os.Chown(data, user, user))
	// Root's secret, held open by root (this test) and deleted: its only name left is /proc/PID/fd/N.
	secretPath := filepath.Join(dir, "secret")
	must(os.WriteFile(secretPath, []byte(strings.Repeat("s", 8192)), 0o600))
	secret, err := os.Open(secretPath)
	must(err)
	t.Cleanup(func() { secret.Close() })
	must(os.Remove(secretPath))
	self, err := os.Executable()
	must(err)
	b, err := os.ReadFile(self)
	must(err)
	exe := filepath.Join(dir, "job")
	must(os.WriteFile(exe, b, 0o755))

	ready := filepath.Join(dir, "ready")
	job := exec.Command(exe)
	job.Dir = dir
	job.Env = append(os.Environ(), roleEnv+"="+holderRole, holdEnv+"="+data, readyEnv+"="+ready)
	job.SysProcAttr = &syscall.SysProcAttr{Setsid: true, Cloneflags: syscall.CLONE_NEWPID}
	must(job.Start())
	t.Cleanup(func() { job.Process.Kill(); job.Wait() })
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if _, err := os.Stat(ready); err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the job did not open its file within 30s")
		}
	}
	images := filepath.Join(dir, "images")
	must(os.Mkdir(images, 0o700))
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	if _, err := (criu.Client{Binary: bin}).Dump(ctx, criu.DumpOptions{PID: job.Process.Pid, ImagesDir: images}); err != nil {
		t.Fatal(err)
	}
	job.Wait()

	must(os.Rename(data, data+".orig"))
	must(os.Symlink(fmt.Sprintf("/proc/%d/fd/%d", os.Getpid(), secret.Fd()), data))
	rep := restoreWithShim(t, Spec{JobID: "j", Mode: ModeRestore, CRIU: bin, ImagesDir: images, UID: user, GID: user,
		ExitFile: filepath.Join(dir, "exit"), Node: "n"})
	if rep.PID != 0 {
		var held []string
		fds, _ := os.ReadDir(fmt.Sprintf("/proc/%d/fd", rep.PID))
		for _, fd := range fds {
			l, _ := os.Readlink(fmt.Sprintf("/proc/%d/fd/%s", rep.PID, fd.Name()))
			held = append(held, fd.Name()+" "+l)
		}
		t.Fatalf("the restore of a job whose file was swapped for a link to root's deleted secret succeeded (pid %d, descriptors: %s)", rep.PID, strings.Join(held, ", "))
	}
	t.Logf("refused: %s", rep.Error)

	must(os.Remove(data))
	must(os.Rename(data+".orig", data))
	rep = restoreWithShim(t, Spec{JobID: "j", Mode: ModeRestore, CRIU: bin, ImagesDir: images, UID: user, GID: user,
		ExitFile: filepath.Join(dir, "exit"), Node: "n"})
	if rep.PID == 0 {
		t.Fatalf("the restore with the job's file back failed: %s", rep.Error)
	}
}

// A job holding a file deleted before the dump restores: CRIU recreates it from the snapshot's copy, with
// no name, and the snapshot says so.
func TestRestoreTakesDeletedFile(t *testing.T) {
	testenv.RequireKernel(t, "CRIU")
	bin, _, err := criu.Require("")
	if err != nil {
		t.Fatal(err)
	}
	dir, err := os.MkdirTemp("/tmp", "shimrestore-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(os.Chmod(dir, 0o755))
	data := filepath.Join(dir, "data")
	must(os.WriteFile(data, make([]byte, 8192), 0o600))
	must(os.Chown(data, 65534, 65534))
	self, err := os.Executable()
	must(err)
	b, err := os.ReadFile(self)
	must(err)
	exe := filepath.Join(dir, "job")
	must(os.WriteFile(exe, b, 0o755))
	ready := filepath.Join(dir, "ready")
	job := exec.Command(exe)
	job.Dir = dir
	job.Env = append(os.Environ(), roleEnv+"="+holderRole, holdEnv+"="+data, readyEnv+"="+ready)
	job.SysProcAttr = &syscall.SysProcAttr{Setsid: true, Cloneflags: syscall.CLONE_NEWPID}
	must(job.Start())
	t.Cleanup(func() { job.Process.Kill(); job.Wait() })
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if _, err := os.Stat(ready); err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the job did not open its file within 30s")
		}
	}
	must(os.Remove(data))
	images := filepath.Join(dir, "images")
	must(os.Mkdir(images, 0o700))
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	if _, err := (criu.Client{Binary: bin}).Dump(ctx, criu.DumpOptions{PID: job.Process.Pid, ImagesDir: images}); err != nil {
		t.Fatal(err)
	}
	job.Wait()
	rep := restoreWithShim(t, Spec{JobID: "j", Mode: ModeRestore, CRIU: bin, ImagesDir: images, UID: 65534, GID: 65534,
		ExitFile: filepath.Join(dir, "exit"), Node: "n"})
	if rep.PID == 0 {
		t.Fatalf("the restore of a job holding a deleted file failed: %s", rep.Error)
	}
	l, _ := os.Readlink(fmt.Sprintf("/proc/%d/fd/5", rep.PID))
	t.Logf("restored; descriptor 5: %s", l)
}
