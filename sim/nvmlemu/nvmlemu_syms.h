/* Every entry point the NVML emulator exports, and how each one behaves.
 *
 * One list, read three ways: nvmlemu.c numbers the symbols for the per-symbol call counters,
 * mapgen.c writes the linker version script of each driver profile from it (a symbol marked absent
 * in a profile is left out of that profile's library, so dlsym fails as on a real driver without
 * it), and the library answers NVML_ERROR_FUNCTION_NOT_FOUND for it when the profile is switched at
 * run time in a process that already loaded the full library.  Anything not listed here is not
 * exported at all.
 *
 * Flags:
 *   EMU_ABSENT_OLD     not in driver_profile "old" (a driver from before these entry points existed)
 *   EMU_ABSENT_CUDA14  not in driver_profile "cuda14" (symbols nvml.h 13.x marks DEPRECATED(13.0))
 *   EMU_MIG_OK         answers on a MIG device handle (everything else answers NOT_SUPPORTED there)
 *   EMU_MIG_PRIV       on the own handle of a GPU with MIG enabled, answers NO_PERMISSION unless the node is
 *                      "privileged" (nvml.h: device-level figures under MIG need "appropriate privileges";
 *                      the GPU instance lookups "Require privileged user")
 */
#ifndef NVMLEMU_SYMS_H
#define NVMLEMU_SYMS_H

#define EMU_ABSENT_OLD    0x1u
#define EMU_ABSENT_CUDA14 0x2u
#define EMU_MIG_OK        0x4u
#define EMU_MIG_PRIV      0x8u

#define EMU_SYMBOLS(X)                                                     \
    X(nvmlInit, 0)                                                         \
    X(nvmlInit_v2, 0)                                                      \
    X(nvmlInitWithFlags, 0)                                                \
    X(nvmlShutdown, 0)                                                     \
    X(nvmlErrorString, 0)                                                  \
    X(nvmlSystemGetDriverVersion, 0)                                       \
    X(nvmlSystemGetNVMLVersion, 0)                                         \
    X(nvmlSystemGetCudaDriverVersion, 0)                                   \
    X(nvmlSystemGetCudaDriverVersion_v2, 0)                                \
    X(nvmlDeviceGetCount, 0)                                               \
    X(nvmlDeviceGetCount_v2, 0)                                            \
    X(nvmlDeviceGetHandleByIndex, 0)                                       \
    X(nvmlDeviceGetHandleByIndex_v2, 0)                                    \
    X(nvmlDeviceGetHandleByUUID, 0)                                        \
    X(nvmlDeviceGetHandleByPciBusId, 0)                                    \
    X(nvmlDeviceGetHandleByPciBusId_v2, 0)                                 \
    X(nvmlDeviceGetIndex, 0)                                               \
    X(nvmlDeviceGetName, EMU_MIG_OK)                                       \
    X(nvmlDeviceGetUUID, EMU_MIG_OK)                                       \
    X(nvmlDeviceGetSerial, 0)                                              \
    X(nvmlDeviceGetPciInfo_v3, 0)                                          \
    X(nvmlDeviceGetNumaNodeId, 0)                                          \
    X(nvmlDeviceGetCpuAffinity, 0)                                         \
    X(nvmlDeviceGetCpuAffinityWithinScope, 0)                              \
    X(nvmlDeviceGetCudaComputeCapability, 0)                               \
    X(nvmlDeviceGetMemoryInfo, EMU_MIG_OK)                                 \
    X(nvmlDeviceGetMemoryInfo_v2, EMU_MIG_OK | EMU_ABSENT_OLD)             \
    X(nvmlDeviceGetUtilizationRates, EMU_MIG_PRIV)                                    \
    X(nvmlDeviceGetEncoderUtilization, EMU_MIG_PRIV)                                  \
    X(nvmlDeviceGetDecoderUtilization, EMU_MIG_PRIV)                                  \
    X(nvmlDeviceGetPowerUsage, 0)                                          \
    X(nvmlDeviceGetTotalEnergyConsumption, 0)                              \
    X(nvmlDeviceGetEnforcedPowerLimit, 0)                                  \
    X(nvmlDeviceGetPowerManagementLimit, 0)                                \
    X(nvmlDeviceGetTemperature, EMU_ABSENT_CUDA14)                         \
    X(nvmlDeviceGetTemperatureV, EMU_ABSENT_OLD)                           \
    X(nvmlDeviceGetClockInfo, 0)                                           \
    X(nvmlDeviceGetMaxClockInfo, 0)                                        \
    X(nvmlDeviceGetCurrentClocksEventReasons, EMU_ABSENT_OLD)              \
    X(nvmlDeviceGetCurrentClocksThrottleReasons, EMU_ABSENT_CUDA14)        \
    X(nvmlDeviceGetCurrPcieLinkGeneration, 0)                              \
    X(nvmlDeviceGetMaxPcieLinkGeneration, 0)                               \
    X(nvmlDeviceGetCurrPcieLinkWidth, 0)                                   \
    X(nvmlDeviceGetMaxPcieLinkWidth, 0)                                    \
    X(nvmlDeviceGetPcieThroughput, 0)                                      \
    X(nvmlDeviceGetPcieReplayCounter, 0)                                   \
    X(nvmlDeviceGetTotalEccErrors, 0)                                      \
    X(nvmlDeviceGetMemoryErrorCounter, 0)                                  \
    X(nvmlDeviceGetRemappedRows, 0)                                        \
    X(nvmlDeviceGetRetiredPages, 0)                                        \
    X(nvmlDeviceGetRetiredPages_v2, 0)                                     \
    X(nvmlDeviceGetRetiredPagesPendingStatus, 0)                           \
    X(nvmlDeviceGetNvLinkState, 0)                                         \
    X(nvmlDeviceGetNvLinkErrorCounter, 0)                                  \
    X(nvmlDeviceGetFieldValues, 0)                                         \
    X(nvmlDeviceGetViolationStatus, 0)                                     \
    X(nvmlDeviceGetVirtualizationMode, 0)                                  \
    X(nvmlDeviceGetGridLicensableFeatures_v4, 0)                           \
    X(nvmlDeviceGetComputeRunningProcesses, EMU_MIG_OK | EMU_MIG_PRIV)                    \
    X(nvmlDeviceGetComputeRunningProcesses_v2, EMU_MIG_OK | EMU_MIG_PRIV)                 \
    X(nvmlDeviceGetComputeRunningProcesses_v3, EMU_MIG_OK | EMU_ABSENT_OLD | EMU_MIG_PRIV) \
    X(nvmlDeviceGetGraphicsRunningProcesses, EMU_MIG_OK)                   \
    X(nvmlDeviceGetGraphicsRunningProcesses_v2, EMU_MIG_OK)                \
    X(nvmlDeviceGetGraphicsRunningProcesses_v3, EMU_MIG_OK | EMU_ABSENT_OLD) \
    X(nvmlDeviceGetProcessUtilization, 0)                                  \
    X(nvmlDeviceGetMigMode, 0)                                             \
    X(nvmlDeviceGetMaxMigDeviceCount, 0)                                   \
    X(nvmlDeviceGetMigDeviceHandleByIndex, 0)                              \
    X(nvmlDeviceIsMigDeviceHandle, EMU_MIG_OK)                             \
    X(nvmlDeviceGetGpuInstanceId, EMU_MIG_OK)                              \
    X(nvmlDeviceGetComputeInstanceId, EMU_MIG_OK)                          \
    X(nvmlDeviceGetDeviceHandleFromMigDeviceHandle, EMU_MIG_OK)            \
    X(nvmlDeviceGetGpuInstanceById, EMU_MIG_PRIV)                                     \
    X(nvmlDeviceGetGpuInstances, EMU_MIG_PRIV)                                        \
    X(nvmlGpuInstanceGetInfo, 0)                                           \
    X(nvmlDeviceGetGpuInstanceProfileInfo, 0)                              \
    X(nvmlDeviceGetGpuInstanceProfileInfoV, 0)                             \
    X(nvmlDeviceGetGpuInstanceProfileInfoByIdV, 0)                         \
    X(nvmlGpmQueryDeviceSupport, EMU_MIG_OK)                               \
    X(nvmlGpmSampleAlloc, 0)                                               \
    X(nvmlGpmSampleFree, 0)                                                \
    X(nvmlGpmSampleGet, EMU_MIG_OK | EMU_MIG_PRIV)                                        \
    X(nvmlGpmMigSampleGet, 0)                                              \
    X(nvmlGpmMetricsGet, 0)                                                \
    X(nvmlEventSetCreate, 0)                                               \
    X(nvmlDeviceGetSupportedEventTypes, 0)                                 \
    X(nvmlDeviceRegisterEvents, 0)                                         \
    X(nvmlEventSetWait, 0)                                                 \
    X(nvmlEventSetWait_v2, 0)                                              \
    X(nvmlEventSetFree, 0)

#endif
