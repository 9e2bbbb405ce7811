// Checkpoints and saved weights are written atomically (issue: reliability): a save that fails (a
// missing folder, a file size limit standing in for a full disk) or a process killed during a
// save leaves the previous file loadable and byte-identical, and a failure says why.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <atomic>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>
#include <thread>
#include <vector>

#include <dirent.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "checkpoint_tensors.h"
#include "error_message.h"
#include "gpt_training.h"
#include "patrickstar/engine/atomic_file.h"
#include "patrickstar/patrickstar.h"
#include "temp_folder.h"

namespace patrickstar {
namespace checkpoint_file_test {

using ::testing::HasSubstr;
using test::error_of;
using namespace test;  // NOLINT: the shared helpers of gpt_training.h

bool exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

// A folder of this test's own, the same in a death test's child (which inherits the variable).
std::string test_folder(const char* name) {
  const std::string variable = std::string("PS_TEST_FOLDER_") + name;
  if (const char* given = std::getenv(variable.c_str())) return given;
  const std::string folder =
      ::testing::TempDir() + "/ps_" + name + "_" + std::to_string(::getpid());
  remove_folder(folder);
  EXPECT_EQ(::mkdir(folder.c_str(), 0755), 0) << folder;
  ::setenv(variable.c_str(), folder.c_str(), 1);
  return folder;
}

std::vector<std::string> leftovers(const std::string& folder) {
  std::vector<std::string> out;
  for (const std::string& name : folder_entries(folder)) {
    if (name.find(".tmp-") != std::string::npos) out.push_back(name);
  }
  return out;
}

TEST(AtomicFile, UncommittedWriterLeavesTheOldFile) {
  const std::string folder = test_folder("atomic_unit");
  const std::string path = folder + "/file";
  std::ofstream(path) << "old";
  {
    AtomicFileWriter writer(path);
    ASSERT_TRUE(writer.write("new content", 11));
    EXPECT_EQ(file_bytes(path), "old");
  }  // no commit: a save that threw before the end
  EXPECT_EQ(file_bytes(path), "old");
  EXPECT_TRUE(leftovers(folder).empty());
  {
    AtomicFileWriter writer(path);
    ASSERT_TRUE(writer.write("new", 3));
    writer.commit();
  }
  EXPECT_EQ(file_bytes(path), "new");
  EXPECT_TRUE(leftovers(folder).empty());
  remove_folder(folder);
}

// Temporary files of killed saves: the next save to the same destination deletes those whose
// process is gone, and nothing else (a live process's, another destination's, other names).
TEST(AtomicFile, TheNextSaveDeletesTheTemporaryFilesOfDeadProcesses) {
  const std::string folder = test_folder("atomic_stale");
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) ::_exit(0);
  ASSERT_EQ(::waitpid(child, nullptr, 0), child);  // reaped: no process has this pid now
  const std::string dead = std::to_string(child);
  const std::string alive = std::to_string(::getppid());  // the process that started this test
  for (const std::string& name : {"file.tmp-" + dead, "file.tmp-" + alive, "other.tmp-" + dead,
                                  "file.tmp-" + dead + "x", std::string("file.tmp-")}) {
    std::ofstream(folder + "/" + name) << "half a checkpoint";
  }
  EXPECT_EQ(remove_stale_temporaries(folder + "/file"), 1);
  EXPECT_EQ(remove_stale_temporaries(folder + "/file"), 0);
  std::ofstream(folder + "/file.tmp-" + dead) << "half a checkpoint";
  {
    AtomicFileWriter writer(folder + "/file");  // what a save does first
    ASSERT_TRUE(writer.write("new", 3));
    writer.commit();
  }
  std::vector<std::string> left = leftovers(folder);
  std::sort(left.begin(), left.end());
  std::vector<std::string> expected = {"file.tmp-", "file.tmp-" + alive,
                                       "file.tmp-" + dead + "x", "other.tmp-" + dead};
  std::sort(expected.begin(), expected.end());
  EXPECT_EQ(left, expected);
  EXPECT_EQ(file_bytes(folder + "/file"), "new");
  remove_folder(folder);
}

TEST(AtomicFile, MissingFolderOrAFileForAFolderIsAClearError) {
  models::Gpt model = make_model(1);
  Engine engine(model.ptr(), tight_config());
  train_step(engine, model, 0);
  const std::string folder = test_folder("atomic_folders");
  EXPECT_THAT(error_of([&] { engine.save_checkpoint(folder + "/missing/ckpt.pt"); }),
              HasSubstr("creating a file in folder \"" + folder +
                        "/missing\" failed: No such file or directory"));
  std::ofstream(folder + "/plain_file") << "x";
  EXPECT_THAT(error_of([&] { engine.save_weights(folder + "/plain_file/weights.pt"); }),
              HasSubstr("Not a directory"));
  EXPECT_THAT(error_of([&] { engine.save_checkpoint(folder + "/"); }), HasSubstr("not a file name"));
  remove_folder(folder);
}

// A full disk, the way one process can have it: a file size limit (RLIMIT_FSIZE) below the
// checkpoint's size, with SIGXFSZ ignored so that write() fails with EFBIG instead of the signal
// ending the process. The previous checkpoint stays byte-identical and loads; the engine trains on
// and saves once the room is back.
TEST(AtomicFile, FullDiskFailsCleanlyAndKeepsThePreviousCheckpoint) {
  const std::string folder = test_folder("atomic_full");
  const std::string path = folder + "/ckpt.pt";
  models::Gpt model = make_model(1);
  Engine engine(model.ptr(), tight_config());
  train_step(engine, model, 0);
  engine.save_checkpoint(path);
  // The checkpoint: its index and its data file (folder_entries: the files the folder holds).
  auto entries = [&] {
    std::vector<std::string> names = folder_entries(folder);
    std::sort(names.begin(), names.end());
    return names;
  };
  const std::vector<std::string> files_before = entries();
  const std::string index_before = file_bytes(path);
  ASSERT_EQ(files_before.size(), 2u);
  std::vector<std::string> bytes_before;
  for (const std::string& name : files_before)
    bytes_before.push_back(file_bytes(folder + "/" + name));
  int64_t checkpoint_bytes = 0;
  for (const std::string& b : bytes_before) checkpoint_bytes += static_cast<int64_t>(b.size());
  ASSERT_GT(checkpoint_bytes, 100000);
  train_step(engine, model, 1);

  rlimit saved{};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &saved), 0);
  auto* previous_handler = std::signal(SIGXFSZ, SIG_IGN);
  rlimit limited = saved;
  limited.rlim_cur = 64 * 1024;  // below the weights' size (about a third of the checkpoint's)
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &limited), 0);
  const std::string weights_error = error_of([&] { engine.save_weights(folder + "/w.pt"); });
  const std::string error = error_of([&] { engine.save_checkpoint(path); });
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &saved), 0);
  std::signal(SIGXFSZ, previous_handler);

  // The data file is the one that does not fit.
  EXPECT_THAT(error, HasSubstr("cannot write \"" + path + "."));
  EXPECT_THAT(error, HasSubstr("writing failed after"));
  EXPECT_THAT(error, HasSubstr("File too large; the file is unchanged"));
  EXPECT_THAT(error, HasSubstr("the checkpoint there before, if any, is unchanged"));
  EXPECT_THAT(weights_error, HasSubstr("File too large"));
  EXPECT_EQ(entries(), files_before);
  for (size_t i = 0; i < files_before.size(); ++i) {
    EXPECT_EQ(file_bytes(folder + "/" + files_before[i]), bytes_before[i]) << files_before[i];
  }
  EXPECT_TRUE(leftovers(folder).empty()) << leftovers(folder).front();
  {
    models::Gpt other = make_model(7);
    Engine reader(other.ptr(), tight_config());
    EXPECT_NO_THROW(reader.load_checkpoint(path));  // the previous checkpoint, whole
  }

  // The engine is untouched by the failed saves: it trains on and saves.
  double loss = 0;
  train_step(engine, model, 2, &loss);
  EXPECT_TRUE(std::isfinite(loss));
  engine.save_checkpoint(path);
  EXPECT_NE(file_bytes(path), index_before);
  EXPECT_EQ(entries().size(), 2u) << "the previous save's data file is removed";
  remove_folder(folder);
}

// A process killed (SIGKILL) during save_checkpoint. Each kill point runs in a child process (a
// "threadsafe" death test: the child runs this test again from the start, so it holds the same
// engine) whose watcher thread kills it once a temporary file of the save has grown to k bytes:
// the data file's (written first) or the index's (written once the data file is in place); the
// last point lets the save finish and kills the child after it. After every kill the checkpoint is
// the previous one or the new one, whole, and it loads.
TEST(AtomicFile, KilledSaveLeavesTheOldCheckpointOrTheNewOne) {
  ::testing::FLAGS_gtest_death_test_style = "threadsafe";
  const std::string folder = test_folder("atomic_kill");
  const std::string path = folder + "/ckpt.pt";
  models::Gpt model = make_model(1);
  Engine engine(model.ptr(), tight_config());
  train_step(engine, model, 0);
  engine.save_checkpoint(path);
  auto iteration_of = [&](const std::string& index) {
    return test::SavedTensors(index).index()["iteration"].get<int64_t>();
  };
  const int64_t old_iteration = iteration_of(path);
  // The sizes of the files a save writes: its index, and its data file (the folder's other file).
  const int64_t index_size = static_cast<int64_t>(file_bytes(path).size());
  int64_t data_size = 0;
  for (const std::string& name : folder_entries(folder)) {
    if (name != "ckpt.pt") data_size = static_cast<int64_t>(file_bytes(folder + "/" + name).size());
  }
  ASSERT_GT(data_size, index_size);
  train_step(engine, model, 1);

  // The temporary file's name holds the saving process's pid: watch the folder for it.
  auto save_and_die_at = [&](bool in_index, int64_t kill_at) {
    std::atomic<bool> done{false};
    std::thread watcher([&] {
      const std::string suffix = ".tmp-" + std::to_string(::getpid());  // this process's
      while (!done.load()) {
        for (const std::string& name : folder_entries(folder)) {
          if (name.size() <= suffix.size() ||
              name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0 ||
              (name == "ckpt.pt" + suffix) != in_index) {
            continue;
          }
          struct stat st {};
          if (::stat((folder + "/" + name).c_str(), &st) == 0 && st.st_size >= kill_at) {
            ::raise(SIGKILL);
          }
        }
      }
    });
    engine.save_checkpoint(path);
    done = true;
    watcher.join();
    ::raise(SIGKILL);  // the save finished: killed right after it
  };

  const std::vector<std::pair<bool, int64_t>> kill_points = {{false, 0},
                                                             {false, data_size / 4},
                                                             {false, data_size / 2},
                                                             {false, data_size - 1},
                                                             {false, data_size},
                                                             {true, 0},
                                                             {true, index_size / 2},
                                                             {true, index_size - 1},
                                                             {true, index_size + 1}};
  int old_kept = 0;
  int new_written = 0;
  for (const auto& [in_index, at] : kill_points) {
    const std::string point =
        std::string(in_index ? "index" : "data file") + " at " + std::to_string(at) + " bytes";
    EXPECT_EXIT(save_and_die_at(in_index, at), ::testing::KilledBySignal(SIGKILL), "");
    const int64_t now = iteration_of(path);
    EXPECT_TRUE(now == old_iteration || now == old_iteration + 1) << point;
    old_kept += now == old_iteration ? 1 : 0;
    new_written += now == old_iteration + 1 ? 1 : 0;
    models::Gpt other = make_model(7);
    Engine reader(other.ptr(), tight_config());
    EXPECT_NO_THROW(reader.load_checkpoint(path)) << point;
  }
  // The next save removes what killed saves left: temporaries of dead processes, data files no
  // index lists.
  engine.save_checkpoint(path);
  EXPECT_TRUE(leftovers(folder).empty()) << leftovers(folder).front();
  EXPECT_EQ(folder_entries(folder).size(), 2u);
  std::printf(
      "killed during a save (data file %lld bytes, index %lld) at %zu points: old "
      "checkpoint kept %d times, new one complete %d times, neither 0 times\n",
      static_cast<long long>(data_size), static_cast<long long>(index_size), kill_points.size(),
      old_kept, new_written);
  // Killed while the data file is written: the old checkpoint stays. Killed after the save: the
  // new one is there.
  EXPECT_GE(old_kept, 5);
  EXPECT_GE(new_written, 1);
  remove_folder(folder);
}

// A checkpoint path in a folder the process may not write to. The folder's mode (0555) refuses a
// normal user; root may write anywhere, so under root the saves run in a child process that has
// given up root for "nobody" (uid and gid 65534) first. Each save is a clear error with the
// system's reason, the previous checkpoint stays byte-identical, and the engine trains on.
TEST(AtomicFile, AReadOnlyFolderIsRefusedAndKeepsThePreviousCheckpoint) {
  ::testing::FLAGS_gtest_death_test_style = "threadsafe";
  constexpr uid_t kNobody = 65534;
  if (::geteuid() == 0) {  // can this process give up root? (a container may not map uid 65534)
    const pid_t probe = ::fork();
    if (probe == 0) ::_exit(::setgid(kNobody) == 0 && ::setuid(kNobody) == 0 ? 0 : 1);
    int status = 0;
    ASSERT_EQ(::waitpid(probe, &status, 0), probe);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      GTEST_SKIP() << "running as root and cannot switch to uid 65534: no read-only folder to try";
    }
  }
  const std::string folder = test_folder("atomic_read_only");
  const std::string path = folder + "/ckpt.pt";
  models::Gpt model = make_model(1);
  Engine engine(model.ptr(), tight_config());
  train_step(engine, model, 0);
  if (!exists(path)) engine.save_checkpoint(path);  // the death test's child finds it there
  const std::string before = file_bytes(path);
  train_step(engine, model, 1);
  ASSERT_EQ(::chmod(folder.c_str(), 0555), 0);

  auto save_without_write_permission = [&] {
    if (::geteuid() == 0 && (::setgid(kNobody) != 0 || ::setuid(kNobody) != 0)) ::_exit(2);
    const std::string checkpoint_error = error_of([&] { engine.save_checkpoint(path); });
    const std::string weights_error = error_of([&] { engine.save_weights(folder + "/w.pt"); });
    std::fprintf(stderr, "save_checkpoint: %s\nsave_weights: %s\n", checkpoint_error.c_str(),
                 weights_error.c_str());
    const std::string expected = "creating a file in folder \"" + folder + "\" failed: Permission denied";
    const bool both = checkpoint_error.find(expected) != std::string::npos &&
                      weights_error.find(expected) != std::string::npos;
    ::_exit(both ? 0 : 1);
  };
  EXPECT_EXIT(save_without_write_permission(), ::testing::ExitedWithCode(0),
              "save_checkpoint: .*Permission denied");
  ASSERT_EQ(::chmod(folder.c_str(), 0755), 0);

  EXPECT_EQ(file_bytes(path), before);
  EXPECT_FALSE(exists(folder + "/w.pt"));
  EXPECT_TRUE(leftovers(folder).empty());
  double loss = 0;
  train_step(engine, model, 2, &loss);
  EXPECT_TRUE(std::isfinite(loss));
  engine.save_checkpoint(path);
  EXPECT_NE(file_bytes(path), before);
  remove_folder(folder);
}

}  // namespace checkpoint_file_test
}  // namespace patrickstar
